"""Command-line options shared by `kvtier batch` and `kvtier bench serve`: the serving engine's config."""

from __future__ import annotations

import argparse

from kvtier.engine.serving_engine import SWAP_MODES, EngineConfig
from kvtier.engine.flash_swap import ALLOCATORS


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
                       help="flash cache file, reused across runs (default: <user cache>/kvtier/kv/)")
    group.add_argument("--flash-allocator", choices=ALLOCATORS, default=defaults.flash_allocator,
                       help="flash slot policy: HiFC append-only log or naive reuse (default %(default)s)")
    group.add_argument("--io-threads", type=int, default=defaults.io_threads,
                       help="swap I/O threads (default %(default)s)")
    group.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs,
                       help="sequences running at once (default %(default)s)")
    group.add_argument("--max-batched-tokens", type=int, default=defaults.max_batched_tokens,
                       help="tokens per forward, bounds prefill chunks (default %(default)s)")


def engine_config_from(args: argparse.Namespace, **overrides: object) -> EngineConfig:
    fields = {
        "block_tokens": args.block_tokens, "device_kv_budget": args.device_kv_budget, "swap": args.swap,
        "swap_space": args.swap_space, "flash_path": args.flash_path, "flash_allocator": args.flash_allocator,
        "io_threads": args.io_threads, "max_num_seqs": args.max_num_seqs,
        "max_batched_tokens": args.max_batched_tokens,
    }
    return EngineConfig(**(fields | overrides)).validated()
