"""`kvtier bench vllm-tier`: kvtier's flash tier vs vLLM's fs tier inside vLLM; bench/results/vllm-tier.json and .md.

Both tiers are driven through vLLM's own SecondaryTierManager interface with the same chunk stream
(see kvtier/eval/serving/vllm_tier.py); needs vLLM installed (`make vllm`, or `pip install 'kvtier[vllm]'`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from kvtier.errors import ConfigError, StorageError
from kvtier.eval.record import machine_info
from kvtier.eval.serving.vllm_tier_report import render_markdown
from kvtier.units import parse_size

DEFAULT_MODELS = "smollm2-135m,qwen2.5-0.5b"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("vllm-tier", description=__doc__.split("\n\n")[1])
    parser.add_argument("--models", default=DEFAULT_MODELS, help="whose 16-token blocks are the chunks (default %(default)s)")
    parser.add_argument("--total", default="512MiB", help="bytes stored and loaded per tier and run (default %(default)s)")
    parser.add_argument("--chunks-per-job", type=int, default=16, help="chunks per store/load job (default %(default)s)")
    parser.add_argument("--window", type=int, default=4, help="jobs in flight at most (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per tier, alternating order (default %(default)s)")
    parser.add_argument("--io-threads", type=int, default=16, help="I/O threads of each tier (default %(default)s)")
    parser.add_argument("--restart-chunks", type=int, default=100_000,
                        help="4 KiB chunks stored before the restart test (default %(default)s)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where both tiers' files go, on the disk under test (default: a temporary directory "
                             "under the current one)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="results directory")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from kvtier.eval.serving.vllm_tier import MODEL_BLOCKS, run_vllm_tier_benchmark

    models = [name.strip() for name in args.models.split(",") if name.strip()]
    unknown = [name for name in models if name not in MODEL_BLOCKS]
    if unknown or not models:
        raise ConfigError(f"unknown model {unknown[0] if unknown else ''!r} for --models; choose from "
                          f"{', '.join(MODEL_BLOCKS)}")
    base = args.dir or Path.cwd()
    if not base.is_dir():
        raise StorageError(f"--dir {base} is not a directory; create it or pass another")
    try:  # only now: vLLM imports torch (seconds), the options are checked first
        import vllm.v1.kv_offload.tiering.spec  # noqa: F401
    except ImportError as error:
        raise ConfigError(f"vLLM 0.33 is not importable ({error}); install it: pip install 'kvtier[vllm]' "
                          "(on a CPU-only machine: make vllm)") from None
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    settings = {"models": models, "total_bytes": parse_size(args.total), "chunks_per_job": args.chunks_per_job,
                "window": args.window, "repeats": args.repeats, "io_threads": args.io_threads,
                "restart_chunks": args.restart_chunks}
    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-tier-", dir=base) as directory:
        result = run_vllm_tier_benchmark(Path(directory), models, settings["total_bytes"], args.chunks_per_job,
                                         args.window, args.repeats, args.io_threads, args.restart_chunks, say)
        machine = machine_info(directory)
    result = {"settings": settings, "machine": machine, "vllm": metadata.version("vllm")} | result
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vllm-tier.json").write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    (args.out / "vllm-tier.md").write_text(render_markdown(result))
    say(f"wrote {args.out / 'vllm-tier.json'} and vllm-tier.md")
    return 0
