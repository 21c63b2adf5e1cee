"""`kvtier bench http`: the HTTP server under 1..64 concurrent streaming clients, against the offline engine.

For each engine setup (by default the two swap backends, flash and DRAM; the random-prompt
workload compares prefill token budgets) a server is started in this process (uvicorn on loopback,
the engine on its thread) and, for each client count c, c closed-loop clients stream `requests(c)`
completions through it (each client sends its next request when the previous one finished). The
same prompts then run through the offline engine (`LLMEngine.generate`, as `kvtier batch` runs)
with `max_num_seqs = c`, which is what c closed-loop clients allow the server: at most c sequences
at a time, a new one admitted as one finishes. Server throughput / offline throughput is the cost
of serving over HTTP (target >= 0.9).

Each server start is followed by one untimed warm-up pass (the first forwards of a process pay for
kernel set-up). Measured per run: generated tokens / wall seconds; time to first token (request sent -> first
streamed text) and inter-token latency (gaps between streamed chunks, one token each) at p50/p99.
Repeats alternate the setups' order and the server/offline order; the tables give medians over
repeats with the spread (min-max). The clients (`load_client`) run in a process of their own, as
a real client would: in the server's process their JSON parsing took the interpreter from the
engine thread. They still share the machine's cores with the server.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from multiprocessing import get_context
from typing import Any

from kvtier.eval.serving.load_client import LevelRun, drive
from kvtier.engine.serving_engine import EngineConfig, LLMEngine
from kvtier.engine.sequence import SamplingParams
from kvtier.http.app import create_app
from kvtier.http.backend import ServerSettings, build_backend
from kvtier.http.runner import ServerThread

BACKENDS = ("flash", "dram")
WARM_UP_REQUESTS = 8  # enough for the first forwards' set-up; more only lengthens the run
SERVED_NAME = "bench"
Progress = Callable[[str], None]


def requests_for(clients: int, per_client: int, minimum: int) -> int:
    """Requests of a level: `per_client` per client, at least `minimum` (so one client gives several samples)."""
    return max(clients * per_client, minimum)


def offline_tokens_per_s(llm: Any, ids: list[list[int]], config: EngineConfig, clients: int, new_tokens: int,
                         fields: dict[str, Any] | None = None) -> float:
    """The offline engine on the same prompts, at most `clients` sequences at a time (engine set-up untimed), sampled
    as the request `fields` say (vLLM's names, which SamplingParams shares; greedy without them).

    Its flash file sits next to the server's (`.offline`): the server's engine keeps its own open.
    """
    flash_path = f"{config.flash_path}.offline" if config.flash_path else None
    sampling = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, **(fields or {}))
    with LLMEngine.from_llm(llm, replace(config, max_num_seqs=clients, flash_path=flash_path)) as engine:
        started = time.perf_counter()
        outputs = engine.generate(ids, sampling)
        wall = time.perf_counter() - started
    return sum(len(output.token_ids) for output in outputs) / wall


def percentile(values: list[float], share: float) -> float:
    """Nearest-rank percentile (0 < share <= 1) of a non-empty sample."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(share * len(ordered)) - 1))]


def run_http_benchmark(llm: Any, prompts: list[str], config: EngineConfig, levels: tuple[int, ...],
                       per_client: int, minimum: int, new_tokens: int, repeats: int,
                       say: Progress = print, setups: dict[str, EngineConfig] | None = None,
                       fields: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Every (setup, level) cell, medians over `repeats` alternating runs, as one JSON-ready dict. `setups`: the
    engine configurations compared, by name (default: `config` with each swap backend); `fields`: request fields
    a setup's requests carry, by setup name (sampling, say; default: greedy)."""
    setups = setups or {f"{backend} swap": replace(config, swap=backend) for backend in BACKENDS}
    fields = {name: (fields or {}).get(name, {}) for name in setups}
    needed = requests_for(max(levels), per_client, minimum)
    if len(prompts) < needed:
        raise ValueError(f"{needed} prompts needed, {len(prompts)} given")
    ids = [list(llm.tokenizer(prompt)["input_ids"]) for prompt in prompts]
    samples: dict[tuple[str, int], list[dict[str, Any]]] = {}
    clients_process = ProcessPoolExecutor(1, mp_context=get_context("spawn"))
    try:
        _measure(llm, prompts, ids, setups, fields, levels, per_client, minimum, new_tokens, repeats,
                 clients_process, samples, say)
    finally:
        clients_process.shutdown()
    return {"levels": list(levels), "setups": {name: asdict(setup) for name, setup in setups.items()},
            "request_fields": fields,
            "repeats": repeats, "new_tokens": new_tokens,
            "requests": {str(c): requests_for(c, per_client, minimum) for c in levels},
            "cells": [_summary(name, clients, runs) for (name, clients), runs in samples.items()]}


def _measure(llm: Any, prompts: list[str], ids: list[list[int]], setups: dict[str, EngineConfig],
             fields: dict[str, dict[str, Any]], levels: tuple[int, ...], per_client: int, minimum: int,
             new_tokens: int, repeats: int,
             clients_process: ProcessPoolExecutor, samples: dict[tuple[str, int], list[dict[str, Any]]],
             say: Progress) -> None:
    """Fill `samples` with one cell per (setup, level) and repeat, in alternating orders."""
    for repeat in range(repeats):
        for name in list(setups) if repeat % 2 == 0 else list(reversed(setups)):
            setup = setups[name]
            server_first = repeat % 2 == 0
            with BenchServer(llm, setup) as (server, engine_stats):
                def served(count: int, clients: int) -> LevelRun:
                    return clients_process.submit(drive, server.url, SERVED_NAME, prompts[:count], clients,
                                                  new_tokens, fields[name]).result()

                served(min(minimum, WARM_UP_REQUESTS), min(levels))  # warm-up, untimed
                engine_stats()
                for clients in levels:
                    count = requests_for(clients, per_client, minimum)
                    cell = _cell(llm, lambda: served(count, clients), ids[:count], setup, clients,
                                 new_tokens, server_first, fields[name])
                    cell["swap_outs"] = engine_stats()
                    samples.setdefault((name, clients), []).append(cell)
                    say(f"[bench http] repeat {repeat + 1}/{repeats} {name} c={clients}: server "
                        f"{cell['server_tokens_per_s']:.1f} tok/s, offline {cell['offline_tokens_per_s']:.1f} tok/s, "
                        f"TTFT p50 {cell['ttft_p50_s'] * 1000:.0f} ms")


def _cell(llm: Any, served: Callable[[], LevelRun], ids: list[list[int]], config: EngineConfig, clients: int,
          new_tokens: int, server_first: bool, fields: dict[str, Any]) -> dict[str, Any]:
    def offline() -> float:
        return offline_tokens_per_s(llm, ids, config, clients, new_tokens, fields)

    if server_first:
        run, offline_rate = served(), offline()
    else:
        offline_rate = offline()
        run = served()
    if run.tokens != len(ids) * new_tokens:
        raise RuntimeError(f"the server generated {run.tokens} tokens, {len(ids) * new_tokens} were asked for")
    return {"server_tokens_per_s": run.tokens_per_s, "offline_tokens_per_s": offline_rate,
            "ratio": run.tokens_per_s / offline_rate, "wall_s": run.wall_s,
            "ttft_p50_s": percentile(run.ttft_s, 0.5), "ttft_p99_s": percentile(run.ttft_s, 0.99),
            "ttft_tail": percentile(run.ttft_s, 0.99) / percentile(run.ttft_s, 0.5),
            "itl_p50_s": percentile(run.itl_s, 0.5), "itl_p99_s": percentile(run.itl_s, 0.99),
            "itl_tail": percentile(run.itl_s, 0.99) / percentile(run.itl_s, 0.5)}


def _summary(setup: str, clients: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median of each measure over the repeats, and its spread."""
    return {"setup": setup, "clients": clients, "runs": runs} | medians(runs, list(runs[0]))


def medians(runs: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """For each of `names`: its median over `runs`, and its spread as `<name>_spread` = [min, max]."""
    cell: dict[str, Any] = {}
    for name in names:
        values = [run[name] for run in runs]
        cell[name] = statistics.median(values)
        cell[f"{name}_spread"] = [min(values), max(values)]
    return cell


class BenchServer:
    """A server for `config` on a thread (long prompts tiered by `tiers`, refused when None); yields it and a reader
    of its engine's swap-out count so far."""

    def __init__(self, llm: Any, config: EngineConfig, tiers: Any = None) -> None:
        self._backend = build_backend(llm, config, ServerSettings(SERVED_NAME), tiers)
        self._thread = ServerThread(create_app(self._backend))
        self._last = 0

    def _swap_outs_since_last(self) -> int:
        total = self._backend.engine_loop.snapshot.swap_outs
        new, self._last = total - self._last, total
        return new

    def __enter__(self) -> tuple[ServerThread, Callable[[], int]]:
        return self._thread, self._swap_outs_since_last

    def __exit__(self, *exc: object) -> None:
        self._thread.stop()


def render_markdown(result: dict[str, Any]) -> str:
    """The benchmark as one table per engine setup plus the method in two lines."""
    lines = [f"# HTTP server benchmark: {result['model']}", "",
             f"`{result['command']}`", "",
             f"Each request streams {result['new_tokens']} tokens (ignore_eos) through /v1/completions; requests "
             f"per level {', '.join(f'{c}: {n}' for c, n in result['requests'].items())}; medians of "
             f"{result['repeats']} alternating repeats, spread (min-max) in brackets. Offline: the same prompts "
             "through the engine with max_num_seqs = clients. Tails: p99 / p50 of each run.", ""]
    lines += _paired(result)
    for name, setup in result["setups"].items():
        pool = f"{setup['device_blocks']} blocks" if setup["device_blocks"] else setup["device_kv_budget"]
        asked = result.get("request_fields", {}).get(name)
        lines += [f"## {name}", "",
                  f"Device pool {pool} of {setup['block_tokens']}-token blocks, {setup['swap']} swap, "
                  f"{setup['max_batched_tokens']} tokens per step at most"
                  f"{f'; requests carry {json.dumps(asked)}' if asked else ''}.", "",
                  "| clients | server tok/s | offline tok/s | server / offline | TTFT p50 ms | TTFT p99 ms "
                  "| TTFT tail | ITL p50 ms | ITL p99 ms | ITL tail | swap-outs |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for cell in (c for c in result["cells"] if c["setup"] == name):
            lines.append(f"| {cell['clients']} | {spread(cell, 'server_tokens_per_s')} | "
                         f"{spread(cell, 'offline_tokens_per_s')} | {spread(cell, 'ratio', 3)} | "
                         f"{spread(cell, 'ttft_p50_s', 0, 1000)} | {spread(cell, 'ttft_p99_s', 0, 1000)} | "
                         f"{spread(cell, 'ttft_tail')} | {spread(cell, 'itl_p50_s', 0, 1000)} | "
                         f"{spread(cell, 'itl_p99_s', 0, 1000)} | {spread(cell, 'itl_tail')} | "
                         f"{cell['swap_outs']:.0f} |")
        lines.append("")
    return "\n".join(lines)


def paired_ratios(result: dict[str, Any]) -> dict[int, list[float]]:
    """Per client count, the second setup's server throughput over the first's, run by run (the repeats alternate
    which goes first, so each pair shares the machine's state)."""
    first, second = list(result["setups"])[:2]
    cells = {(cell["setup"], cell["clients"]): cell for cell in result["cells"]}
    return {clients: [b["server_tokens_per_s"] / a["server_tokens_per_s"]
                      for a, b in zip(cells[first, clients]["runs"], cells[second, clients]["runs"])]
            for clients in result["levels"]}


def _paired(result: dict[str, Any]) -> list[str]:
    """With request fields compared: a table of the paired throughput ratios."""
    if len(result["setups"]) != 2 or not any(result.get("request_fields", {}).values()):
        return []
    first, second = list(result["setups"])
    lines = [f"## {second} / {first}", "", "| clients | server tok/s ratio, median | runs |", "|---|---|---|"]
    for clients, ratios in paired_ratios(result).items():
        lines.append(f"| {clients} | {statistics.median(ratios):.3f} | {', '.join(f'{r:.3f}' for r in ratios)} |")
    return lines + [""]


def spread(cell: dict[str, Any], name: str, digits: int = 1, scale: float = 1.0) -> str:
    """`cell[name]` and its spread (`medians`) as text, scaled by `scale`, `digits` after the point."""
    low, high = cell[f"{name}_spread"]
    return f"{cell[name] * scale:.{digits}f} [{low * scale:.{digits}f}-{high * scale:.{digits}f}]"
