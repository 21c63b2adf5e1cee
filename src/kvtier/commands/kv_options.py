"""Command-line options shared by every command that builds a KV cache."""

import argparse

from kvtier.modes import KV_MODES, KVConfig
from kvtier.models.loader import TORCH_DTYPES
from kvtier.models.registry import DEFAULT_MODEL
from kvtier.sparse.cold.sketch import SCORE_BITS


def add_model_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"packaged model name, local HF dir or .gguf path (default {DEFAULT_MODEL})")


def add_dtype_option(parser: argparse.ArgumentParser, default: str = "float32") -> None:
    # float32 is the default: the GGUF weights dequantize exactly into it, and it is the reference the
    # KV modes are checked against; bfloat16 halves the KV bytes and uses the CPU's bf16 matmuls.
    parser.add_argument("--dtype", choices=tuple(TORCH_DTYPES), default=default,
                        help="dtype of the weights, activations and KV cache (default %(default)s)")


def add_kv_options(parser: argparse.ArgumentParser, default_kv: str = "dense") -> None:
    defaults = KVConfig()
    group = parser.add_argument_group("KV cache")
    group.add_argument("--kv", choices=KV_MODES, default=default_kv, help=f"KV mode (default {default_kv})")
    group.add_argument("--device-kv-budget", default=defaults.device_kv_budget, help="KV bytes on the compute device, e.g. 64MiB")
    group.add_argument("--host-kv-budget", default=defaults.host_kv_budget, help="KV bytes in host DRAM (0 = no host tier)")
    group.add_argument("--storage-dir", default=None, help="directory for KV files (default: <user cache>/kvtier/kv)")
    group.add_argument("--block-tokens", type=int, default=defaults.block_tokens, help="tokens per KV block")
    group.add_argument("--io-threads", type=int, default=defaults.io_threads, help="I/O threads for the disk tier")
    sparse = parser.add_argument_group("selective KV (--kv sparse, h2o, infinigen, leoam)")
    sparse.add_argument("--alpha", type=float, default=defaults.alpha, help="importance rate: share of pooled tokens attended per step")
    sparse.add_argument("--score-bits", type=int, choices=SCORE_BITS, default=defaults.score_bits, help="key sketch precision (the sketches draw up the cold shortlist that exact scores rank)")
    sparse.add_argument("--beta", default=defaults.beta, help="hot/cold split Mc/Ms, or 'auto' (calibrated latency model)")
    sparse.add_argument("--sink", type=int, default=defaults.sink, help="first tokens always attended")
    sparse.add_argument("--recent", type=int, default=defaults.recent, help="last tokens always attended")
    sparse.add_argument("--no-lookahead", dest="lookahead", action="store_false",
                        help="--kv sparse: score each layer's cold pool with its own query only, instead of "
                             "prefetching its candidates with a query predicted from the previous layer (done for "
                             "layers with at least 256 cold tokens per sequence)")


def kv_config_from(args: argparse.Namespace) -> KVConfig:
    return KVConfig(
        kv=args.kv,
        device_kv_budget=args.device_kv_budget,
        host_kv_budget=args.host_kv_budget,
        storage_dir=args.storage_dir,
        block_tokens=args.block_tokens,
        io_threads=args.io_threads,
        alpha=args.alpha,
        score_bits=args.score_bits,
        beta=args.beta,
        sink=args.sink,
        recent=args.recent,
        lookahead=args.lookahead,
    ).validated()

