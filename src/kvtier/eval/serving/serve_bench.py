"""`kvtier bench serve`: HiFC's evaluation on this machine, flash swap vs DRAM swap in one run.

Measured, all in the same process and on the same disk:
- end-to-end throughput of flash swap vs DRAM swap (medians over repeats, alternating order) and of
  recompute-only preemption, with their swap counts (equal by construction: the schedule never
  depends on I/O timing) and whether every backend produced the same tokens;
- raw swap bandwidth (bytes moved / seconds inside the copies) next to the disk's sequential
  O_DIRECT bandwidth measured with the same I/O engine;
- a block-size sweep 16..256 (the HiFC paper, Fig. 6);
- the share of swap-outs that are sequential appends, HiFC's log vs naive lowest-slot reuse, from
  the engine and from a longer allocator replay (Fig. 5), with logical overwrites as a WAF proxy;
- engine start-up: opening a pre-generated flash file vs allocating a DRAM pool of the same size.
Flash reads and writes use O_DIRECT (no page cache) wherever the filesystem allows it.
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvtier.eval.serving.workload import SWEEP_BLOCKS, Workload
from kvtier.kv.model_geometry import model_geometry
from kvtier.engine.swap.dram import DramSwap
from kvtier.engine.serving_engine import EngineConfig, LLMEngine, flash_backend
from kvtier.engine.swap.flash import FlashSwap
from kvtier.engine.kv_pool import KVPool
from kvtier.storage import IOEngine, aligned_buffer, open_direct
from kvtier.storage.flash_log import FlashLog, NaiveReuseAllocator, SlotAllocator
from kvtier.units import format_size

Progress = Callable[[str], None]


def run_serve_benchmark(llm: Any, workload: Workload, flash_dir: Path, block_tokens: int = 64,
                        repeats: int = 3, io_threads: int = 16, init_bytes: int = 1 << 30,
                        sweep: tuple[int, ...] = SWEEP_BLOCKS, extra_runs: bool = True,
                        say: Progress = print) -> dict[str, Any]:
    """Every measurement above as one JSON-ready dict (top-level `flash_vs_dram`, `swap_out_bytes`, `wall_s`).

    `extra_runs=False` skips the naive-allocator and recompute engine runs (each as long as a flash
    run; on a slow CPU that halves the benchmark); the allocator replay still compares the policies.
    """
    encode = lambda text: llm.tokenizer(text)["input_ids"]  # noqa: E731  raw text: no chat template
    prompts = workload.prompts(encode)
    runner = _Runner(llm, prompts, workload, flash_dir, io_threads, say)
    main = runner.compare(block_tokens, repeats)
    extras = {"flash_naive_allocator": runner.once("flash", block_tokens, flash_allocator="naive"),
              "recompute": runner.once("recompute", block_tokens)} if extra_runs else {}
    sweep_rows = [runner.sweep_row(tokens) for tokens in sweep]
    disk = disk_sequential_bandwidth(flash_dir, max(256 << 20, 2 * main["flash"]["swap"]["out_bytes"]), io_threads)
    flash_run = main["flash"]
    return {
        "flash_vs_dram": main["flash_vs_dram"],
        "swap_out_bytes": flash_run["swap"]["out_bytes"],
        "wall_s": flash_run["wall_s"],
        "workload": workload.to_dict() | {"prompt_tokens": sum(map(len, prompts)), "block_tokens": block_tokens,
                                          "device_blocks": flash_run["device_blocks"]},
        "io": {"threads": io_threads, "flash_direct_io": flash_run["direct_io"], "flash_io": flash_run["io_backend"],
               "dram_io": main["dram"]["io_backend"], "repeats": repeats},
        "throughput": {"flash": main["flash"], "dram": main["dram"]} | extras,
        "same_outputs": main["same_outputs"] and all(run["digest"] == flash_run["digest"] for run in extras.values()),
        "bandwidth": {"flash_swap_out": flash_run["swap"]["out_bandwidth"],
                      "flash_swap_in": flash_run["swap"]["in_bandwidth"],
                      "dram_swap_out": main["dram"]["swap"]["out_bandwidth"],
                      "dram_swap_in": main["dram"]["swap"]["in_bandwidth"]} | disk,
        "block_size_sweep": sweep_rows,
        "allocation": {"engine_log": _allocation(flash_run),
                       "engine_naive": _allocation(extras["flash_naive_allocator"]) if extras else None,
                       "replay": allocator_replay()},
        "write_amplification": write_amplification_note(),
        "init": init_times(llm, flash_dir, init_bytes, block_tokens, io_threads),
    }


class _Runner:
    """Runs the workload through fresh engines and summarises each run."""

    def __init__(self, llm: Any, prompts: list[list[int]], workload: Workload, flash_dir: Path, io_threads: int,
                 say: Progress) -> None:
        self.llm, self.prompts, self.workload = llm, prompts, workload
        self.flash_dir, self.io_threads, self.say = flash_dir, io_threads, say

    def once(self, swap: str, block_tokens: int, **overrides: Any) -> dict[str, Any]:
        demand = sum(len(p) + self.workload.new_tokens for p in self.prompts)
        config = EngineConfig(block_tokens=block_tokens, swap=swap, io_threads=self.io_threads,
                              device_blocks=self.workload.device_blocks(self.prompts, block_tokens),
                              swap_space=self._swap_space(demand),
                              flash_path=str(self.flash_dir / f"bench-flash-{block_tokens}.kvc"), **overrides)
        engine = LLMEngine.from_llm(self.llm, config)
        try:
            with tqdm(total=len(self.prompts), desc=f"{swap} block {block_tokens}", unit="req", file=sys.stderr,
                      leave=False) as bar:
                started = time.perf_counter()
                outputs = engine.generate(self.prompts, self.workload.sampling, progress=lambda _: bar.update())
                wall = time.perf_counter() - started
            stats = engine.stats()
            direct = engine.swap.file.direct if isinstance(engine.swap, FlashSwap) else None
            io_backend = engine.swap.io_backend if engine.swap is not None else None
        finally:
            engine.close()
        tokens = sum(len(output.token_ids) for output in outputs)
        row = {"backend": swap, "block_tokens": block_tokens, "wall_s": wall, "generated_tokens": tokens,
               "tokens_per_s": tokens / wall, "device_blocks": stats["device_blocks"],
               "scheduler": stats["scheduler"], "swap": stats.get("swap", {}), "direct_io": direct,
               "io_backend": io_backend,
               "digest": hash(tuple(tuple(output.token_ids) for output in outputs))}
        self.say(f"  {swap:<9} block {block_tokens:>3}: {wall:6.1f}s, {row['tokens_per_s']:7.1f} tok/s, "
                 f"{stats['scheduler']['swap_outs']} swap-outs, {stats['scheduler']['recomputes']} recomputes")
        return row

    def warm_up(self, block_tokens: int) -> None:
        """On a GPU, one untimed run per block size before the timed ones.

        On the H200 the first run at a new block size was slow whichever backend it used (CUDA's
        lazy start-up and first allocations of the run's shapes, most likely): the first flash run
        at block 64 made 13 tok/s against 112-124 for every later run, and a sweep row run
        flash-first gave flash/DRAM 0.44 at block 16 without the warm-up, 0.79 with it. It does not
        cover kvikio's own first use: the first flash run after it still made 44.5 tok/s (cause not
        profiled; the median of 3 runs leaves it out of the main ratio). A CPU has no such
        first-run cost (sweep rows within +-6% without a warm-up), so none is spent there.
        """
        if self.llm.model.device.type == "cuda":
            self.say(f"  warm-up run at block {block_tokens} (not timed):")
            self.once("recompute", block_tokens)

    def compare(self, block_tokens: int, repeats: int) -> dict[str, Any]:
        self.warm_up(block_tokens)
        runs: dict[str, list[dict[str, Any]]] = {"flash": [], "dram": []}
        for repeat in range(repeats):
            for swap in ("flash", "dram") if repeat % 2 == 0 else ("dram", "flash"):
                runs[swap].append(self.once(swap, block_tokens))
        medians = {swap: _median_run(rows) for swap, rows in runs.items()}
        digests = {row["digest"] for rows in runs.values() for row in rows}
        return medians | {"flash_vs_dram": medians["flash"]["tokens_per_s"] / medians["dram"]["tokens_per_s"],
                          "same_outputs": len(digests) == 1}

    def sweep_row(self, block_tokens: int) -> dict[str, Any]:
        self.warm_up(block_tokens)
        flash, dram = self.once("flash", block_tokens), self.once("dram", block_tokens)
        return {"block_tokens": block_tokens, "flash_tokens_per_s": flash["tokens_per_s"],
                "dram_tokens_per_s": dram["tokens_per_s"],
                "flash_vs_dram": flash["tokens_per_s"] / dram["tokens_per_s"],
                "flash_swap_outs": flash["scheduler"]["swap_outs"], "dram_swap_outs": dram["scheduler"]["swap_outs"],
                "flash_swap_out_bandwidth": flash["swap"]["out_bandwidth"],
                "dram_swap_out_bandwidth": dram["swap"]["out_bandwidth"]}

    def _swap_space(self, demand_tokens: int) -> int:
        """Twice the workload's whole KV (plus block padding): a swap-out never finds the space full."""
        return demand_tokens * model_geometry(self.llm.model).token_bytes * 2 + (64 << 20)


def _median_run(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ordered = sorted(rows, key=lambda row: row["tokens_per_s"])
    median = dict(ordered[len(ordered) // 2])
    median["tokens_per_s_runs"] = [row["tokens_per_s"] for row in rows]
    median["tokens_per_s"] = statistics.median(median["tokens_per_s_runs"])
    return median


def _allocation(run: dict[str, Any]) -> dict[str, Any]:
    swap = run["swap"]
    return {name: swap.get(name) for name in ("appends", "sequential_appends", "sequential_share", "overwrites",
                                              "reclaimed_segments", "slots")}


def allocator_replay(swap_outs: int = 1000, slots: int = 1024, seed: int = 0) -> dict[str, Any]:
    """The same random swap-out / swap-in trace on both policies (the HiFC paper's Fig. 5 runs 500 swap-outs)."""
    results = {}
    for allocator in (FlashLog(slots), NaiveReuseAllocator(slots)):
        rng = random.Random(seed)
        live: list[list[int]] = []
        for _ in range(swap_outs):
            size = rng.randint(1, 16)
            while allocator.free_slots < size or (live and rng.random() < 0.5):
                allocator.free(live.pop(rng.randrange(len(live))))  # a random swapped sequence comes back
            live.append(allocator.allocate(size))
        results[type(allocator).__name__] = _allocator_stats(allocator)
    return {"swap_outs": swap_outs, "slots": slots} | results


def _allocator_stats(allocator: SlotAllocator) -> dict[str, Any]:
    return {"sequential_share": allocator.sequential_share, "overwrites": allocator.overwrites,
            "appends": allocator.appends, "reclaimed_segments": getattr(allocator, "reclaimed_segments", 0)}


def disk_sequential_bandwidth(directory: Path, nbytes: int, threads: int,
                              run_bytes: int = 1 << 20) -> dict[str, Any]:
    """Sequential O_DIRECT write then read of `nbytes` in `run_bytes` runs over `threads` threads."""
    path = directory / "bench-sequential.tmp"
    nbytes = -(-nbytes // run_bytes) * run_bytes
    buffer = aligned_buffer(run_bytes)
    buffer[:] = 7
    fd, direct = open_direct(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        runs = [(offset, [memoryview(buffer)]) for offset in range(0, nbytes, run_bytes)]
        with IOEngine(threads) as io:
            write_s = _timed(lambda: io.write_runs(fd, runs))
            os.fsync(fd)
            readers = [(offset, [memoryview(aligned_buffer(run_bytes))]) for offset, _ in runs[:threads]]
            read_s = _timed(lambda: io.read_runs(fd, [(offset, readers[i % threads][1])
                                                      for i, (offset, _) in enumerate(runs)]))
    finally:
        os.close(fd)
        path.unlink()
    return {"disk_sequential_write": nbytes / write_s, "disk_sequential_read": nbytes / read_s,
            "disk_test_bytes": nbytes, "disk_direct_io": direct}


def _timed(action: Callable[[], None]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def write_amplification_note() -> dict[str, Any]:
    """True WAF needs the drive's NAND-write counters (SMART); say whether this machine exposes them."""
    smartctl = shutil.which("smartctl")
    return {"smart_available": smartctl is not None,
            "note": "logical overwrites (slots written again) are the WAF proxy; "
                    + ("run smartctl -A before and after for the drive's NAND writes" if smartctl else
                       "SMART data is not available here (no smartctl, virtual disk), so true WAF is not measured")}


def init_times(llm: Any, flash_dir: Path, nbytes: int, block_tokens: int, io_threads: int,
               repeats: int = 3) -> dict[str, Any]:
    """Seconds to open a pre-generated flash cache vs to allocate a host pool of the same size."""
    geometry = model_geometry(llm.model)
    pool = KVPool(geometry, 1, block_tokens, llm.model.device)
    slots = max(1, nbytes // (geometry.num_layers * 2 * pool.layout.block_stride))
    path = flash_dir / f"bench-init-{block_tokens}.kvc"
    flash_swap = flash_backend(pool.device)
    # kept between opens: the flash cache's claim is that reopening a pre-created file is near free
    created = _timed(lambda: flash_swap(pool, path, slots, llm.model_id, io_threads, keep_file=True).close())
    flash = [_timed(lambda: flash_swap(pool, path, slots, llm.model_id, io_threads, keep_file=True).close())
             for _ in range(repeats)]
    dram = [_timed(lambda: DramSwap(pool, slots, io_threads).close()) for _ in range(repeats)]
    return {"bytes": slots * geometry.num_layers * 2 * pool.layout.block_stride, "slots": slots,
            "flash_create_s": created, "flash_open_s": statistics.median(flash),
            "dram_alloc_s": statistics.median(dram)}


def render_markdown(result: dict[str, Any]) -> str:
    """The benchmark as a short report: tables of throughput, bandwidth, sweep, allocation and init."""
    throughput, bandwidth, init = result["throughput"], result["bandwidth"], result["init"]
    workload = result["workload"]
    lines = [
        f"# Serve benchmark (HiFC swap path): {result['model']}",
        "",
        f"Workload: {workload['requests']} requests of {workload['min_prompt_tokens']}-{workload['max_prompt_tokens']} "
        f"prompt tokens, {workload['new_tokens']} new tokens each (`--scale {result['scale']}` of the full "
        f"32 x 2K-8K); device pool {workload['device_blocks']} blocks of {workload['block_tokens']} tokens "
        f"(~{workload['pool_fraction']:.0%} of the demand). {_repeats_text(result['io']['repeats'])} "
        f"{'One untimed warm-up run per block size. ' if result.get('device', 'cpu').startswith('cuda') else ''}"
        f"Model and KV pool on {result.get('device', 'cpu')} ({result.get('dtype', 'float32')}"
        f"{', random weights: --load-format dummy' if result.get('load_format') == 'dummy' else ''}). "
        f"Flash I/O: {_flash_io(result['io'])}; {result['io']['threads']} threads.",
        "",
        f"**flash / DRAM throughput: {result['flash_vs_dram']:.3f}** (target >= 0.95); "
        f"identical outputs across backends: {result['same_outputs']}",
        "",
        "| backend | tok/s | runs (tok/s) | wall s | swap-in stall s | swap-outs | swap-ins | recomputes | swap-out bytes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, run in throughput.items():
        scheduler, swap = run["scheduler"], run["swap"]
        runs = ", ".join(f"{value:.2f}" for value in run.get("tokens_per_s_runs", [run["tokens_per_s"]]))
        lines.append(f"| {name} | {run['tokens_per_s']:.2f} | {runs} | {run['wall_s']:.1f} | "
                     f"{swap.get('in_seconds', 0.0):.2f} | {scheduler['swap_outs']} | {scheduler['swap_ins']} | "
                     f"{scheduler['recomputes']} | {format_size(swap.get('out_bytes', 0))} |")
    lines += ["", "Swap-in stall: seconds a resumed sequence waited for its KV (swap-ins are synchronous; "
              "swap-outs overlap the running batch). Wall and stall are those of the median run."]
    lines += ["", "| bandwidth | GB/s |", "|---|---|"]
    for name in ("flash_swap_out", "flash_swap_in", "dram_swap_out", "dram_swap_in", "disk_sequential_write",
                 "disk_sequential_read"):
        lines.append(f"| {name.replace('_', ' ')} | {bandwidth[name] / 1e9:.2f} |")
    if result["block_size_sweep"]:
        lines += ["", "| block tokens | flash tok/s | DRAM tok/s | flash/DRAM | swap-outs (flash, DRAM) |",
                  "|---|---|---|---|---|"]
        for row in result["block_size_sweep"]:
            lines.append(f"| {row['block_tokens']} | {row['flash_tokens_per_s']:.1f} | {row['dram_tokens_per_s']:.1f} "
                         f"| {row['flash_vs_dram']:.3f} | {row['flash_swap_outs']}, {row['dram_swap_outs']} |")
    allocation = result["allocation"]
    replay = allocation["replay"]
    lines += ["", "| allocation | sequential share of swap-outs | logical overwrites |", "|---|---|---|",
              f"| engine, HiFC log | {allocation['engine_log']['sequential_share']:.3f} | "
              f"{allocation['engine_log']['overwrites']} |",
              _naive_row(allocation["engine_naive"]),
              f"| replay of {replay['swap_outs']} swap-outs, HiFC log | {replay['FlashLog']['sequential_share']:.3f} | "
              f"{replay['FlashLog']['overwrites']} |",
              f"| replay, naive reuse | {replay['NaiveReuseAllocator']['sequential_share']:.3f} | "
              f"{replay['NaiveReuseAllocator']['overwrites']} |",
              "", f"Write amplification: {result['write_amplification']['note']}.",
              "", f"Init with {format_size(init['bytes'])} of swap space: open the pre-generated flash file "
              f"{init['flash_open_s'] * 1000:.1f} ms (creating it took {init['flash_create_s'] * 1000:.1f} ms) vs "
              f"allocating the DRAM pool {init['dram_alloc_s'] * 1000:.1f} ms.", ""]
    return "\n".join(lines)


def _flash_io(io: dict[str, Any]) -> str:
    """How flash bytes moved; results written before the kvikio backend only say whether O_DIRECT was on."""
    if io.get("flash_io"):
        return io["flash_io"]
    return "O_DIRECT" if io["flash_direct_io"] else "buffered (no O_DIRECT here)"


def _naive_row(naive: dict[str, Any] | None) -> str:
    if naive is None:
        return "| engine, naive reuse | not run (`--no-extra-runs`) | |"
    return f"| engine, naive reuse | {naive['sequential_share']:.3f} | {naive['overwrites']} |"


def _repeats_text(repeats: int) -> str:
    return "One run per engine (no medians)." if repeats == 1 else f"Medians of {repeats} runs."
