"""Command-line options shared by every command that builds a KV cache (no torch import: options are checked at
once, before a command loads a model)."""

import argparse
import logging

from kvtier.kv_config import KV_MODES, KVConfig
from kvtier.models.registry import DEFAULT_MODEL
from kvtier.sparse import SCORE_BITS
from kvtier.sparse.settings import DEFAULT_TOP_P, SparseSettings
from kvtier.storage.geometry import DTYPE_SIZES

log = logging.getLogger(__name__)


def add_model_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"packaged model name, local HF dir or .gguf path (default {DEFAULT_MODEL})")


def add_dtype_option(parser: argparse.ArgumentParser, default: str = "float32") -> None:
    # float32 is the default: the GGUF weights dequantize exactly into it, and it is the reference the
    # KV modes are checked against; bfloat16 halves the KV bytes and uses the CPU's bf16 matmuls.
    # the dtypes a KV can be laid out in are the ones the loader loads weights in (models.loader.TORCH_DTYPES)
    parser.add_argument("--dtype", choices=tuple(DTYPE_SIZES), default=default,
                        help="dtype of the weights, activations and KV cache (default %(default)s)")


def add_kv_options(parser: argparse.ArgumentParser, default_kv: str = "dense") -> None:
    defaults = KVConfig()
    group = parser.add_argument_group("KV cache")
    group.add_argument("--kv", choices=KV_MODES, default=default_kv, help=f"KV mode (default {default_kv})")
    group.add_argument("--device-kv-budget", default=defaults.device_kv_budget, action=_Budget,
                       help="KV bytes on the compute device, e.g. 64MiB")
    group.add_argument("--host-kv-budget", default=defaults.host_kv_budget, action=_Budget,
                       help="KV bytes in host DRAM (0 = no host tier)")
    group.add_argument("--storage-dir", default=None, help="directory for KV files (default: <user cache>/kvtier/kv)")
    group.add_argument("--block-tokens", type=int, default=defaults.block_tokens, help="tokens per KV block")
    group.add_argument("--io-threads", type=int, default=defaults.io_threads, help="I/O threads for the disk tier")
    sparse = parser.add_argument_group("selective KV (--kv sparse, h2o, infinigen, leoam, quest)")
    add_budget_options(sparse, "importance rate: share of pooled tokens attended per step; 'auto' (--kv sparse): the "
                               f"adaptive budget at --top-p {DEFAULT_TOP_P}", "--kv sparse: ")
    sparse.add_argument("--score-bits", type=int, choices=SCORE_BITS, default=defaults.score_bits, help="key sketch precision (the sketches draw up the cold shortlist that exact scores rank)")
    sparse.add_argument("--beta", default=defaults.beta, help="hot/cold split Mc/Ms, or 'auto' (calibrated latency model)")
    sparse.add_argument("--sink", type=int, default=defaults.sink, help="first tokens always attended")
    sparse.add_argument("--recent", type=int, default=defaults.recent, help="last tokens always attended")
    sparse.add_argument("--no-lookahead", dest="lookahead", action="store_false",
                        help="--kv sparse: score each layer's cold pool with its own query only, instead of "
                             "prefetching its candidates with a query predicted from the previous layer (done for "
                             "layers with at least 256 cold tokens per sequence)")


def add_budget_options(group: argparse._ArgumentGroup, alpha_help: str, top_p_prefix: str = "") -> None:
    """--alpha (a share, or 'auto') and --top-p: how many tokens a selective step attends (`budget_from`)."""
    group.add_argument("--alpha", type=_alpha, default=KVConfig.alpha, help=alpha_help)
    group.add_argument("--top-p", type=float, default=None,
                       help=f"{top_p_prefix}attend per layer and step the fewest tokens whose estimated attention mass "
                            f"reaches this (between {SparseSettings.min_share * 100:g}%% and "
                            f"{SparseSettings.max_share * 100:g}%% of the pooled tokens, more where the mass stays "
                            "low); alpha then only plans the hot/cold split")


def budget_from(args: argparse.Namespace) -> dict[str, float | None]:
    """KVConfig's alpha and top_p from `add_budget_options`' options ('auto': the adaptive budget at its default)."""
    return {"alpha": KVConfig.alpha if args.alpha == "auto" else args.alpha,
            "top_p": DEFAULT_TOP_P if args.alpha == "auto" and args.top_p is None else args.top_p}


def _alpha(text: str) -> float | str:
    """--alpha: a number, or 'auto' (the adaptive budget)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a share in (0, 1] or 'auto', got {text!r}") from None


class _Budget(argparse.Action):
    """Stores a budget and notes that it was given: `--kv dense` keeps every token on the device and says so."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        namespace.budgets_given = [*getattr(namespace, "budgets_given", []), option_string]


def kv_config_from(args: argparse.Namespace) -> KVConfig:
    """The validated KVConfig of the options; a warning when they give budgets that `--kv dense` ignores."""
    given = getattr(args, "budgets_given", [])
    if args.kv == "dense" and given:
        log.warning("--kv dense keeps all the KV on the device: %s ignored; choose a tiered mode (--kv offload, "
                    "sparse, ...) to bound it", " and ".join(dict.fromkeys(given)))
    return KVConfig(
        kv=args.kv,
        device_kv_budget=args.device_kv_budget,
        host_kv_budget=args.host_kv_budget,
        storage_dir=args.storage_dir,
        block_tokens=args.block_tokens,
        io_threads=args.io_threads,
        **budget_from(args),
        score_bits=args.score_bits,
        beta=args.beta,
        sink=args.sink,
        recent=args.recent,
        lookahead=args.lookahead,
    ).validated()

