"""Prometheus metrics of one server, named with a `kvtier:` prefix as vLLM prefixes its own with `vllm:`.

Request-side metrics (tokens, latencies, queue times, finished requests) are recorded by the handlers
as tokens reach them; engine-side ones (queues, blocks, swap traffic, flash file, tiered sequences'
KV per tier) are read at scrape time from the engine loop's latest snapshot. Each server has its own
registry, so several servers in one process (tests, the benchmark) never mix. Requests are labelled by
`path`: "paged" (KV in the engine's block pool) or "tiered" (HillInfer's tiers, kvtier.engine.tiered).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.http.engine_loop import EngineSnapshot
from kvtier.sparse.stats import MASS_BUCKETS

# Latencies of a CPU-served small model run from milliseconds to minutes under load.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    """The registry behind /metrics and the request-side instruments."""

    def __init__(self, engine: Callable[[], EngineSnapshot]) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.prompt_tokens = Counter("kvtier:prompt_tokens", "Prompt tokens of admitted requests", registry=registry)
        self.generation_tokens = Counter("kvtier:generation_tokens", "Generated tokens", registry=registry)
        self.requests = Counter("kvtier:requests", "Requests admitted, by the path serving them", ["path"],
                                registry=registry)
        self.finished = Counter("kvtier:request_success", "Finished requests by finish reason", ["finished_reason"],
                                registry=registry)
        self.ttft = Histogram("kvtier:time_to_first_token_seconds", "Request arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("kvtier:inter_token_latency_seconds", "Time between consecutive tokens of a request",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram("kvtier:e2e_request_latency_seconds", "Request arrival to its last token",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.queue_time = Histogram("kvtier:request_queue_time_seconds",
                                    "Request arrival at the engine to the first forward that ran it",
                                    buckets=LATENCY_BUCKETS, registry=registry)
        registry.register(_EngineCollector(engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    def __init__(self, engine: Callable[[], EngineSnapshot]) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self._engine()
        tiered = engine.tiered_counters
        yield _gauge("kvtier:num_requests_running", "Requests generating now", "path",
                     {"paged": engine.running, "tiered": engine.tiered_running})
        yield _gauge("kvtier:num_requests_waiting", "Requests queued for admission", "path",
                     {"paged": engine.waiting, "tiered": engine.tiered_waiting})
        yield _gauge("kvtier:num_requests_swapped", "Preempted requests whose KV sits in swap space", None,
                     engine.swapped)
        yield _gauge("kvtier:device_blocks_total", "KV blocks of the engine's device pool", None, engine.device_blocks)
        yield _gauge("kvtier:device_blocks_free", "Free KV blocks of the device pool", None, engine.device_blocks_free)
        yield _kv_bytes(engine)
        yield _gauge("kvtier:swap_slots_total", "Block slots of the swap space (flash file or DRAM pool)", None,
                     engine.swap_slots)
        yield _gauge("kvtier:swap_slots_used", "Swap slots holding a swapped-out block", None, engine.swap_slots_live)
        yield _gauge("kvtier:flash_file_bytes", "Size of the flash cache file on disk (0 without flash swap)", None,
                     engine.swap_file_bytes)
        for name, doc, value in (
                ("kvtier:swap_outs", "Sequences swapped out", engine.swap_outs),
                ("kvtier:swap_ins", "Sequences swapped back in", engine.swap_ins),
                ("kvtier:swap_out_bytes", "Bytes written to swap space", engine.swap_out_bytes),
                ("kvtier:swap_in_bytes", "Bytes read back from swap space", engine.swap_in_bytes),
                ("kvtier:preemptions", "Sequences preempted for blocks", engine.preemptions),
                ("kvtier:recomputes", "Sequences whose KV was dropped and recomputed", engine.recomputes),
                ("kvtier:tiered_requests", "Tiered requests that started (their KV opened)", tiered.get("requests", 0)),
                ("kvtier:tiered_sit_outs", "Steps the tiered sequences sat out so that a short prompt's forward ran "
                 "without their sparse steps", engine.tiered_sit_outs),
                ("kvtier:tiered_cold_read_bytes", "Bytes tiered sequences read from their cold pools on disk",
                 tiered.get("cold_read_bytes", 0)),
                ("kvtier:tiered_scorer_restarts", "Restarts of the tiered sequences' storage scorer processes",
                 tiered.get("scorer_restarts", 0)),
                ("kvtier:tiered_reused_prompt_tokens", "Tiered prompt tokens loaded from the document KV store",
                 tiered.get("reused_prompt_tokens", 0)),
                ("kvtier:tiered_kv_store_read_bytes", "Bytes tiered sequences read from the document KV store",
                 tiered.get("kv_store_read_bytes", 0)),
                ("kvtier:tiered_set_asides", "Tiered sequences preempted: window and hot pool set aside on flash",
                 tiered.get("set_asides", 0)),
                ("kvtier:tiered_set_aside_bytes", "Bytes tiered sequences wrote to flash when set aside",
                 tiered.get("set_aside_bytes", 0)),
                ("kvtier:tiered_guard_events", "Layer steps whose top-p budget's guard lifted its ceiling (mass too "
                 "flat to keep P within it)", tiered.get("guard_events", 0))):
            yield CounterMetricFamily(name, doc, value=value)
        yield _mass_kept(tiered)


def _mass_kept(tiered: dict) -> HistogramMetricFamily:
    """The tiered sequences' decode steps by their estimated attention mass kept (kvtier.sparse.mass; each step's
    mean over its layers)."""
    buckets = [(str(bound), tiered.get(f"mass_kept_le_{bound}", 0)) for bound in MASS_BUCKETS]
    return HistogramMetricFamily("kvtier:tiered_attention_mass_kept", "Estimated attention mass a tiered sequence's "
                                 "decode step kept (mean over its layers)",
                                 buckets=[*buckets, ("+Inf", tiered.get("mass_kept_count", 0))],
                                 sum_value=tiered.get("mass_kept_sum", 0.0))


def _kv_bytes(engine: EngineSnapshot) -> GaugeMetricFamily:
    """KV bytes per path and tier: the paged pool's used blocks and swap space; the tiered sequences' three tiers
    (their device windows counted where they lie, not as the pool blocks reserved for them)."""
    paged = {"device": (engine.device_blocks - engine.device_blocks_free) * engine.block_bytes
             - engine.tiered_reserved_bytes}
    if engine.swap_slots:  # flash or dram; recompute keeps no swapped KV
        paged[engine.swap_backend] = engine.swap_slots_live * engine.block_bytes
    family = GaugeMetricFamily("kvtier:kv_bytes", "KV bytes held now, per path and tier", labels=["path", "tier"])
    for path, tiers in (("paged", paged), ("tiered", engine.tiered_kv_bytes)):
        for tier, value in tiers.items():
            family.add_metric([path, tier], value)
    return family


def _gauge(name: str, doc: str, label: str | None, values: int | dict[str, int]) -> GaugeMetricFamily:
    if label is None:
        return GaugeMetricFamily(name, doc, value=values)
    family = GaugeMetricFamily(name, doc, labels=[label])
    for key, value in values.items():
        family.add_metric([key], value)
    return family
