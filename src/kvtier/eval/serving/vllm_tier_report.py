"""`kvtier bench vllm-tier`'s result as markdown (apart from kvtier.eval.serving.vllm_tier, which imports vLLM)."""

from __future__ import annotations

from typing import Any

from kvtier.units import format_size


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
