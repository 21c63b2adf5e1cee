"""`kvtier bench http --workload documents`: long documents' questions served together, tiered, against serving them
one at a time and against the paged engine alone.

Four documents of about `document_tokens` tokens (the packaged corpus, each with two planted facts)
are stored first (one untimed request each fills the document KV store); then every client streams
one question at once, two per document, `new_tokens` greedy tokens each. Three servers, fresh for
each run, in alternating order over the repeats:

    tiered   the engine with tiered sequences, `max_tiered_seqs` at once, each with an equal share of the
             host budget
    sliced   the same, each tiered sequence yielding its share to a waiting question after `tiered_slice`
             tokens (set aside on flash, brought back later)
    serial   the same engine and per-sequence budgets, one tiered sequence at a time (how long prompts
             were served before: a single worker)
    paged    the engine alone, its device pool as large as the tiered run's device and host budgets
             together (it admits the prompts), flash swap, no document store

Reported per server: aggregate decode throughput, time to first token and inter-token latency
(p50 / p99), bytes read from disk per generated token (cold pools and the store for tiered sequences,
swap-ins for paged), the peak device and host KV bytes sampled from /metrics during the run against the
budgets, and whether every answer matches the tiered run's and names its fact.

Mixed traffic, once on the tiered server (`mixed_traffic`): short chat requests, one after another, on the
idle server and then while one question per document decodes as a tiered sequence; their time to first token
(p50) with and without the long requests.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvtier.data.corpus import load_corpus
from kvtier.data.needle import build_haystack, make_needles, score_answer
from kvtier.docstore.document_store import DocumentStore
from kvtier.engine.serving_engine import EngineConfig
from kvtier.eval.accuracy.corpus_slice import CHARS_PER_TOKEN_BOUND, corpus_slice
from kvtier.eval.serving.documents_workload import DocumentsWorkload
from kvtier.eval.serving.http_bench import SERVED_NAME, BenchServer, medians, percentile, spread
from kvtier.eval.serving.load_client import LevelRun, drive
from kvtier.kv_config import KVConfig
from kvtier.tiered_kv import SparseTiers
from kvtier.units import parse_size

SERVERS = ("tiered", "sliced", "serial", "paged")
QUESTIONS_PER_DOCUMENT = 2
SAMPLE_S = 0.25  # how often /metrics is read for the peak KV bytes
SHORT_REQUESTS = 8  # mixed traffic: short chat requests, one after another


@dataclass(frozen=True)
class Question:
    prompt: str
    expected: str
    document: int


def questions(llm: Any, workload: DocumentsWorkload) -> list[Question]:
    """Two questions per document, each asking for one of the document's two planted facts."""
    corpus = load_corpus("auto", CHARS_PER_TOKEN_BOUND * workload.document_tokens * (workload.documents + 1),
                         progress=False)
    asked = []
    for number in range(workload.documents):
        needles = make_needles(QUESTIONS_PER_DOCUMENT, seed=number)
        text = corpus_slice(corpus.text, number, workload.document_tokens)
        for ask in range(QUESTIONS_PER_DOCUMENT):
            prompt = build_haystack(llm.tokenizer, text, workload.document_tokens, needles, [0.3, 0.7], ask)
            asked.append(Question(_user_turn(llm, prompt.prompt), prompt.expected, number))
    return asked


def _user_turn(llm: Any, text: str) -> str:
    """`text` as the model's chat template frames a user's turn (small chat models answer only when asked so); sent
    to /v1/completions, whose tokenizer reads the template's special tokens back."""
    if not llm.has_chat_template:
        return text
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)


def run_documents_benchmark(llm: Any, workload: DocumentsWorkload, base: EngineConfig, directory: Path,
                            say=print) -> dict[str, Any]:
    """Every server's runs over `workload.repeats` alternating repeats, as one JSON-ready dict."""
    asked = questions(llm, workload)
    prompts = [question.prompt for question in asked]
    configs = _configs(base, workload, directory)
    store_dir = directory / "bench-documents-store"  # kept across runs: a rerun finds its documents stored
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SERVERS}
    clients = ProcessPoolExecutor(1, mp_context=get_context("spawn"))
    try:
        with BenchServer(llm, configs["tiered"], _tiers(llm, "tiered", store_dir, directory)) as (server, _):
            # stores the documents, untimed
            clients.submit(drive, server.url, SERVED_NAME, prompts[::QUESTIONS_PER_DOCUMENT], workload.documents,
                           2).result()
            mixed = mixed_traffic(llm, server.url, prompts[::QUESTIONS_PER_DOCUMENT], workload.new_tokens, clients)
            say(f"[bench http documents] short requests' TTFT p50: {mixed['idle_ttft_p50_s'] * 1000:.0f} ms idle, "
                f"{mixed['busy_ttft_p50_s'] * 1000:.0f} ms beside {mixed['tiered_decoding']} tiered sequences")
        for repeat in range(workload.repeats):
            for name in SERVERS if repeat % 2 == 0 else tuple(reversed(SERVERS)):
                with BenchServer(llm, configs[name], _tiers(llm, name, store_dir, directory)) as (server, _):
                    with _Sampler(server.url) as peaks:
                        run = clients.submit(drive, server.url, SERVED_NAME, prompts, len(prompts),
                                             workload.new_tokens).result()
                    cell = _cell(run, peaks, asked, server.url)
                runs[name].append(cell)
                say(f"[bench http documents] repeat {repeat + 1}/{workload.repeats} {name}: "
                    f"{cell['tokens_per_s']:.2f} tok/s, TTFT p99 {cell['ttft_p99_s']:.1f} s, "
                    f"{cell['correct']}/{len(asked)} facts")
    finally:
        clients.shutdown()
    reference = runs["tiered"][0]["texts"]
    return {"workload": asdict(workload), "questions": len(asked),
            "budgets": {"device": parse_size(workload.device_kv_budget), "host": parse_size(workload.host_kv_budget)},
            "servers": {name: _summary(cells, reference) for name, cells in runs.items()}, "mixed": mixed,
            "engines": {name: asdict(config) for name, config in configs.items()}}


def mixed_traffic(llm: Any, url: str, long_prompts: list[str], new_tokens: int, clients: ProcessPoolExecutor
                  ) -> dict[str, Any]:
    """Short chat requests' time to first token on the idle server at `url`, then while `long_prompts` decode
    (they are sent together from the `clients` process; the short ones, one at a time, from here, once every
    long one has its first token)."""
    short = [_user_turn(llm, f"Say one word about the number {number}.") for number in range(SHORT_REQUESTS)]
    idle = drive(url, SERVED_NAME, short, 1, 1)
    first_tokens = ("kvtier:time_to_first_token_seconds_count", ())  # one per request given its first token
    admitted = ("kvtier:requests_total", (("path", "tiered"),))
    before = scrape(url)
    started = before.get(first_tokens, 0.0)
    long_run = clients.submit(drive, url, SERVED_NAME, long_prompts, len(long_prompts), new_tokens)
    while scrape(url).get(first_tokens, 0.0) < started + len(long_prompts):
        if long_run.done():
            raise RuntimeError("the long requests finished before the short ones could be sent beside them")
        time.sleep(SAMPLE_S)
    decoding = scrape(url).get(("kvtier:num_requests_running", (("path", "tiered"),)), 0.0)
    busy = drive(url, SERVED_NAME, short, 1, 1)
    overlapped = not long_run.done()  # the long requests still decoded when the last short one was answered
    long_run.result()
    tiered = scrape(url).get(admitted, 0.0) - before.get(admitted, 0.0)
    idle_p50, busy_p50 = percentile(idle.ttft_s, 0.5), percentile(busy.ttft_s, 0.5)
    return {"short_requests": SHORT_REQUESTS, "tiered": int(tiered), "tiered_decoding": int(decoding),
            "idle_ttft_p50_s": idle_p50,
            "busy_ttft_p50_s": busy_p50, "ratio": busy_p50 / idle_p50, "overlapped": overlapped}


def _configs(base: EngineConfig, workload: DocumentsWorkload, directory: Path) -> dict[str, EngineConfig]:
    device, host = parse_size(workload.device_kv_budget), parse_size(workload.host_kv_budget)
    tiered = replace(base, device_kv_budget=device, host_kv_budget=host, max_tiered_seqs=workload.max_tiered_seqs,
                     device_blocks=None, flash_path=str(directory / "bench-documents.kvc"))
    return {"tiered": tiered, "sliced": replace(tiered, tiered_slice=workload.tiered_slice),
            "serial": replace(tiered, host_kv_budget=host // workload.max_tiered_seqs, max_tiered_seqs=1),
            "paged": replace(tiered, device_kv_budget=device + host)}


def _tiers(llm: Any, server: str, store_dir: Path, directory: Path) -> SparseTiers | None:
    """The tiered sequences of `server` (none for the paged engine alone), cold pools in `directory`."""
    if server == "paged":
        return None
    return SparseTiers(llm, KVConfig(kv="sparse", storage_dir=str(directory)), DocumentStore(store_dir))


class _Sampler:
    """Reads /metrics every SAMPLE_S seconds while the run lasts; keeps the peak device and host KV bytes."""

    def __init__(self, url: str) -> None:
        self._url, self._stop = url, threading.Event()
        self.device = self.host = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            kv = kv_bytes(scrape(self._url))
            self.device = max(self.device, kv[("paged", "device")] + kv[("tiered", "device")])
            self.host = max(self.host, kv[("tiered", "host")])


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics").text
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def kv_bytes(metrics: dict[tuple[str, tuple], float]) -> dict[tuple[str, str], float]:
    values = {(dict(labels)["path"], dict(labels)["tier"]): value
              for (name, labels), value in metrics.items() if name == "kvtier:kv_bytes"}
    return {key: values.get(key, 0.0) for key in [("paged", "device"), ("tiered", "device"), ("tiered", "host")]}


def _cell(run: LevelRun, peaks: _Sampler, asked: list[Question], url: str) -> dict[str, Any]:
    metrics = scrape(url)
    read = sum(metrics.get((name, ()), 0.0) for name in
               ("kvtier:tiered_cold_read_bytes_total", "kvtier:tiered_kv_store_read_bytes_total",
                "kvtier:swap_in_bytes_total"))
    return {"tokens_per_s": run.tokens_per_s, "wall_s": run.wall_s,
            "ttft_p50_s": percentile(run.ttft_s, 0.5), "ttft_p99_s": percentile(run.ttft_s, 0.99),
            "itl_p50_s": percentile(run.itl_s, 0.5), "itl_p99_s": percentile(run.itl_s, 0.99),
            "ttft_s": run.ttft_s, "read_bytes_per_token": read / run.tokens, "peak_device_bytes": peaks.device,
            "peak_host_bytes": peaks.host, "set_asides": metrics.get(("kvtier:tiered_set_asides_total", ()), 0.0),
            "set_aside_bytes": metrics.get(("kvtier:tiered_set_aside_bytes_total", ()), 0.0),
            "correct": sum(score_answer(text, question.expected) for text, question in zip(run.texts, asked)),
            "texts": run.texts}


def _summary(cells: list[dict[str, Any]], reference: list[str]) -> dict[str, Any]:
    """Medians with their spread over the repeats, the peaks' maxima, and how many answers match `reference`."""
    summary: dict[str, Any] = {"runs": [{k: v for k, v in cell.items() if k != "texts"} for cell in cells]}
    summary |= medians(cells, ["tokens_per_s", "wall_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
                               "read_bytes_per_token"])
    summary["peak_device_bytes"] = max(cell["peak_device_bytes"] for cell in cells)
    summary["peak_host_bytes"] = max(cell["peak_host_bytes"] for cell in cells)
    summary["correct"] = min(cell["correct"] for cell in cells)
    summary["same_answers"] = min(sum(a == b for a, b in zip(cell["texts"], reference)) for cell in cells)
    return summary


def render_documents_markdown(result: dict[str, Any]) -> str:
    """One row per server; tiered vs serial and vs paged as ratios under the table."""
    workload, servers, budgets = result["workload"], result["servers"], result["budgets"]
    lines = [f"# Long documents served together: {result['model']}", "", f"`{result['command']}`", "",
             f"{workload['documents']} stored documents of ~{workload['document_tokens']} tokens, "
             f"{result['questions']} questions streamed at once, {workload['new_tokens']} tokens each; budgets: "
             f"device {budgets['device'] >> 20} MiB, host {budgets['host'] >> 20} MiB; medians of "
             f"{workload['repeats']} alternating repeats, spread in brackets.", "",
             "| server | tok/s | TTFT p50 s | TTFT p99 s | ITL p50 ms | ITL p99 ms | read KiB/token "
             "| peak device MiB | peak host MiB | facts | same answers |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, cell in servers.items():
        lines.append(f"| {name} | {spread(cell, 'tokens_per_s', 2)} | {spread(cell, 'ttft_p50_s', 1)} | "
                     f"{spread(cell, 'ttft_p99_s', 1)} | {spread(cell, 'itl_p50_s', 0, 1000)} | "
                     f"{spread(cell, 'itl_p99_s', 0, 1000)} | {spread(cell, 'read_bytes_per_token', 0, 1 / 1024)} | "
                     f"{cell['peak_device_bytes'] / 2**20:.0f} | {cell['peak_host_bytes'] / 2**20:.0f} | "
                     f"{cell['correct']}/{result['questions']} | {cell['same_answers']}/{result['questions']} |")
    tiered, sliced, serial, mixed = servers["tiered"], servers["sliced"], servers["serial"], result["mixed"]
    lines += ["", f"Tiered vs serial: throughput {tiered['tokens_per_s'] / serial['tokens_per_s']:.2f}x, "
                  f"TTFT p99 {tiered['ttft_p99_s'] / serial['ttft_p99_s']:.2f}x; vs paged: throughput "
                  f"{tiered['tokens_per_s'] / servers['paged']['tokens_per_s']:.2f}x. Sliced (every "
                  f"{workload['tiered_slice']} tokens) vs serial: throughput "
                  f"{sliced['tokens_per_s'] / serial['tokens_per_s']:.2f}x, TTFT p99 "
                  f"{sliced['ttft_p99_s'] / serial['ttft_p99_s']:.2f}x.", "",
              f"Mixed traffic (tiered server): {mixed['short_requests']} short requests one after another, time to "
              f"first token p50 {mixed['idle_ttft_p50_s'] * 1000:.0f} ms on the idle server, "
              f"{mixed['busy_ttft_p50_s'] * 1000:.0f} ms while {mixed['tiered_decoding']} tiered sequences decode "
              f"({mixed['ratio']:.1f}x).", ""]
    return "\n".join(lines)
