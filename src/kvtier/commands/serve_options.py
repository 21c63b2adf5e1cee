"""Command-line options shared by `kvtier serve`, `kvtier batch` and `kvtier bench serve`: the serving engine's config,
with its tiered sequences (long prompts)."""

from __future__ import annotations

import argparse

from kvtier.commands.kv_options import add_budget_options, budget_from
from kvtier.engine.config import ALLOCATORS, SWAP_MODES, EngineConfig
from kvtier.sparse.settings import DEFAULT_TOP_P


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    defaults = EngineConfig()
    group = parser.add_argument_group("serving engine")
    group.add_argument("--block-tokens", type=int, default=defaults.block_tokens,
                       help="tokens per KV block, 16-256 (default %(default)s)")
    group.add_argument("--device-kv-budget", default=defaults.device_kv_budget,
                       help="device KV pool size, e.g. 256MiB (default %(default)s)")
    group.add_argument("--swap", choices=SWAP_MODES, default=defaults.swap,
                       help="where preempted KV goes (default %(default)s)")
    group.add_argument("--swap-space", default=defaults.swap_space,
                       help="flash file / host swap pool size (default %(default)s)")
    group.add_argument("--flash-path", default=None,
                       help="flash swap file, locked while in use and deleted at exit "
                            "(default: <user cache>/kvtier/kv/flash-<model>-<block tokens>.kvc)")
    group.add_argument("--flash-allocator", choices=ALLOCATORS, default=defaults.flash_allocator,
                       help="flash slot policy: HiFC append-only log or naive reuse (default %(default)s)")
    group.add_argument("--io-threads", type=int, default=defaults.io_threads,
                       help="swap I/O threads (default %(default)s)")
    group.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs,
                       help="sequences running at once (default %(default)s)")
    group.add_argument("--max-batched-tokens", type=int, default=defaults.max_batched_tokens,
                       help="tokens per forward, bounds prefill chunks (default %(default)s)")
    tiered = parser.add_argument_group("long prompts (tiered sequences: HillInfer's tiers under the engine)")
    tiered.add_argument("--no-sparse", dest="sparse", action="store_false",
                        help="refuse prompts beyond the device pool instead of serving them as tiered sequences")
    tiered.add_argument("--host-kv-budget", default=defaults.host_kv_budget,
                        help="host DRAM for the tiered sequences' hot pools, over all of them (default %(default)s)")
    tiered.add_argument("--max-tiered-seqs", type=int, default=defaults.max_tiered_seqs,
                        help="tiered sequences running at once, each with an equal share of the host budget "
                             "(default %(default)s)")
    tiered.add_argument("--tiered-slice", type=int, default=defaults.tiered_slice,
                        help="decode tokens after which a tiered sequence yields its share to a waiting long request, "
                             "its window and hot pool set aside on flash (default %(default)s: never)")
    tiered.add_argument("--storage-dir", default=None,
                        help="directory of the tiered sequences' cold-pool files (default: <user cache>/kvtier/kv)")
    add_budget_options(tiered, "share of a tiered sequence's pooled tokens attended per decode step (default "
                               f"%(default)s); 'auto': the adaptive budget at --top-p {DEFAULT_TOP_P}")


def engine_config_from(args: argparse.Namespace, **overrides: object) -> EngineConfig:
    fields = {
        "block_tokens": args.block_tokens, "device_kv_budget": args.device_kv_budget, "swap": args.swap,
        "swap_space": args.swap_space, "flash_path": args.flash_path, "flash_allocator": args.flash_allocator,
        "io_threads": args.io_threads, "max_num_seqs": args.max_num_seqs,
        "max_batched_tokens": args.max_batched_tokens, "host_kv_budget": args.host_kv_budget,
        "max_tiered_seqs": args.max_tiered_seqs, "tiered_slice": args.tiered_slice,
    }
    return EngineConfig(**(fields | overrides)).validated()


def tiers_from(args: argparse.Namespace, llm, store=None):
    """The tiered sequences' provider for `llm` (None with --no-sparse): the sparse path's defaults at --alpha or
    --top-p, its cold pools under --storage-dir, documents reused from and stored to `store` (a DocumentStore, or
    None)."""
    if not args.sparse:
        return None
    from kvtier.kv_config import KVConfig
    from kvtier.tiered_kv import SparseTiers

    return SparseTiers(llm, KVConfig(kv="sparse", storage_dir=args.storage_dir, **budget_from(args)), store)
