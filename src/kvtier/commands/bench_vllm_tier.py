"""`kvtier bench vllm-tier`: kvtier's flash tier vs vLLM's fs tier inside vLLM; bench/results/vllm-tier.json and .md.

Both tiers are driven through vLLM's own SecondaryTierManager interface with the same chunk stream
(see kvtier/integrations/vllm/bench.py); needs vLLM installed (`make vllm`, or `pip install 'kvtier[vllm]'`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError, StorageError
from kvtier.eval.record import machine_info
from kvtier.units import format_size, parse_size

DEFAULT_MODELS = "smollm2-135m,qwen2.5-0.5b"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("vllm-tier", help="kvtier's flash tier vs vLLM's fs tier, inside vLLM",
                                   description=__doc__.split("\n\n")[1])
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
    from kvtier.integrations.vllm.bench import MODEL_BLOCKS, run_vllm_tier_benchmark

    try:
        import vllm.v1.kv_offload.tiering.spec  # noqa: F401
    except ImportError as error:
        raise ConfigError(f"vLLM 0.33 is not importable ({error}); install it: pip install 'kvtier[vllm]' "
                          "(on a CPU-only machine: make vllm)") from None

    models = [name.strip() for name in args.models.split(",") if name.strip()]
    unknown = [name for name in models if name not in MODEL_BLOCKS]
    if unknown or not models:
        raise ConfigError(f"unknown model {unknown[0] if unknown else ''!r} for --models; choose from "
                          f"{', '.join(MODEL_BLOCKS)}")
    base = args.dir or Path.cwd()
    if not base.is_dir():
        raise StorageError(f"--dir {base} is not a directory; create it or pass another")
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


def render_markdown(result: dict[str, Any]) -> str:
    settings = result["settings"]
    lines = [
        "# vLLM secondary tier: kvtier's flash tier vs vLLM's fs tier",
        "",
        f"Both built by vLLM {result['vllm']}'s TieringOffloadingSpec and driven "
        f"through its SecondaryTierManager interface with the same chunk stream: {format_size(settings['total_bytes'])} "
        f"stored then loaded per tier and run, jobs of {settings['chunks_per_job']} chunks, at most "
        f"{settings['window']} in flight, {settings['io_threads']} I/O threads per tier; medians of "
        f"{settings['repeats']} runs (alternating order), min-max in brackets. Disk: "
        f"{_disk(result['machine'])}. vLLM's fs tier ran "
        f"{'its C I/O extension' if result['fs_native_io'] else 'its Python I/O path (its C extension links CUDA libraries, absent here)'}.",
        "",
        "| model (chunk) | tier | store GB/s | load GB/s | store job p50 / p99 ms | load job p50 / p99 ms | "
        "files created (fs: + its config.json) | O_DIRECT | sequential share of writes (log) | physically "
        "sequential writes (FIEMAP) | logical overwrites |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, entry in result["models"].items():
        for tier, row in entry["tiers"].items():
            lines.append(
                f"| {model} ({format_size(entry['chunk_bytes'])}) | {tier} | {_cell(row['store_gb_per_s'])} | "
                f"{_cell(row['load_gb_per_s'])} | {row['store_job_p50_ms']['median']:.1f} / "
                f"{row['store_job_p99_ms']['median']:.1f} | {row['load_job_p50_ms']['median']:.1f} / "
                f"{row['load_job_p99_ms']['median']:.1f} | {row['files_created']} | {row['direct']} | "
                f"{_share(row['sequential_share'])} | {_physical(row['physical_sequential_share'])} | "
                f"{_share(row['overwrites'])} |")
    restart = result["restart"]
    lines += [
        "",
        f"Restart: {restart['chunks']} chunks of {format_size(restart['chunk_bytes'])} stored, then a new tier started "
        "on the same files and timed until every chunk was looked up as a hit:",
        "",
        "| tier | restart + lookup of every chunk, s | hits |",
        "|---|---|---|",
    ]
    for tier, seconds in restart["seconds"].items():
        lines.append(f"| {tier} | {_cell(seconds, 3)} | {restart['hits'][tier]} |")
    lines += ["", "fs: one new file per chunk, placed by the filesystem (no log, so no log share or overwrite "
              "count); kvtier: appends at the flash log's head (sequential share of allocations). Physically "
              "sequential: the share of chunk writes, in submission order, that start on the device where the "
              "previous one ended (FIEMAP after the store phase). "
              "Every run's failed jobs: " + ", ".join(
                  f"{model} {tier} {row['failed_jobs']}" for model, entry in result["models"].items()
                  for tier, row in entry["tiers"].items()) + "; a sample of each run's chunks was compared byte for "
              "byte after loading.", ""]
    return "\n".join(lines)


def _cell(value: dict[str, float], digits: int = 2) -> str:
    return f"{value['median']:.{digits}f} [{value['min']:.{digits}f}-{value['max']:.{digits}f}]"


def _physical(value: dict[str, float] | None) -> str:
    return "n/a (no FIEMAP here)" if value is None else _cell(value, 3)


def _share(value: Any) -> str:
    return "n/a" if value is None else (f"{value:.3f}" if isinstance(value, float) else str(value))


def _disk(machine: dict[str, Any]) -> str:
    disk = machine.get("disk", {})
    return f"{disk.get('fstype')} on {disk.get('device')} (rotational: {disk.get('rotational')})"
