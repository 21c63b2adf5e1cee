"""APP: the latency model that splits the pooled tokens between hot (host) and cold (storage) pools.

The HillInfer paper's eq. (2): per layer and step the host path costs
    T_CPU     = Mc / f_c + alpha_c * Mc / B_c    (score the hot pool, fetch its selected tokens)
and the storage path
    T_storage = Ms / f_s + alpha_s * Ms / B_s    (scorer reads + scores sketches, fetch selected cold K/V)
Balancing them gives beta = Mc / Ms = (1/f_s + alpha_s/B_s) / (1/f_c + alpha_c/B_c), which with
alpha_c = alpha_s = alpha is eq. (4). Subject to Mc <= M0 (host budget, eq. 3).

One term is added to the paper's model: the storage path also pays a fixed round trip R per
scorer request (query hand-off, wake-up, first read, result hand-back: one request per layer and
step for the whole batch), so T_storage = R / batch + Ms / f_s + alpha_s * Ms / B_s per sequence.
Balancing with Mc + Ms = M gives Mc = (R / batch + M * c_s) / (c_c + c_s), with c_c and c_s the
per-token costs above; R = 0 is eq. (4) again. At short contexts the round trip, not the scan, is
the storage path's cost.

Skew correction: HKM puts the important tokens in the hot pool, so the hot pool's selection
rate alpha_c exceeds alpha and the cold pool's alpha_s falls below it. We estimate both from the
prompt's observation-window importance (the same signal placement uses): place with beta, count
how much of the top-alpha set lands hot and cold, recompute beta, and iterate to a fixed point.
That estimate is in-sample (placement already put exactly that set hot), so with a hot pool larger
than the top-alpha set it says alpha_s = 0 while decode picks a few cold tokens; a held-out estimate
was tried and was worse at long contexts. Results record the planned rates beside the measured ones
(`planned_selection_rates`).

Units are tokens (of one layer and sequence) and tokens per second. `calibrate` measures the four
throughputs on this machine with the real code paths (HotPool scoring, the gather of
the selected tokens' values, the scorer process reading O_DIRECT sketches, cold K/V record reads) and caches
them per machine, storage device, geometry and torch thread count in
`~/.cache/kvtier/sparse-calibration.json`; `refresh=True` measures again. The host rates scale with
the thread count, so they are measured on the threads a sparse layer's step runs on
(`kvtier.sparse.threads.LAYER_STEP_THREADS`), whatever the model's decode uses.
Why those three: without the round trip APP chose a beta slower than every fixed one at 2K; a held-out
skew estimate misplanned 32K badly; one thread's and two threads' host rates differ about twofold.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from kvtier.paths import cache_dir
from kvtier.sparse.cold.cold_pool import ColdPool, kv_record_bytes
from kvtier.sparse.hot.hot_pool import HotPool
from kvtier.sparse.hot.initial_placement import split_hot_cold
from kvtier.sparse.protocol import Channel, ChannelSpec
from kvtier.sparse.scorer.client import ScorerClient
from kvtier.sparse.selection import PooledSegment, weighs_in_place
from kvtier.sparse.settings import SparseSettings
from kvtier.sparse.cold.sketch import SketchFormat
from kvtier.storage import IOEngine
from kvtier.sparse.threads import LAYER_STEP_THREADS, torch_threads

log = logging.getLogger(__name__)
CALIBRATION_TOKENS = 16384
CALIBRATION_VERSION = 9  # part of the cache key: bump when `calibrate` measures something new (2: round trip,
# 3: host fetch includes placing the tokens, as decode does; 4: the host fetch gathers values only and the
# scorer scores prepared, dequantized sketches; 5: each scorer request is timed after its preparation;
# 6: the scorer scores the codes in compiled code; 7: f_s includes the scorer's sketch reads again; 8: the hot
# pool's keys in tiles, scored by the kernel; 9: the host fetch is the chosen values' weighted sum, read in place)
SKEW_ITERATIONS = 4
PREPARE_PAUSE_S = 0.02  # longer than the scorer takes to prepare a calibration-sized layer


@dataclass(frozen=True)
class Throughputs:
    """Tokens per second of one layer and sequence on each path."""

    host_score: float  # f_c
    storage_score: float  # f_s (disk reads of sketches included)
    host_fetch: float  # B_c
    storage_fetch: float  # B_s
    storage_round_trip: float = 0.0  # R: seconds per scorer request, whatever its size


def balanced_beta(rates: Throughputs, alpha_host: float, alpha_storage: float, pool: int, batch: int = 1) -> float:
    """Mc / Ms that makes T_CPU equal T_storage for a pool of `pool` tokens per sequence (inf: all hot)."""
    host_cost = 1 / rates.host_score + alpha_host / rates.host_fetch
    storage_cost = 1 / rates.storage_score + alpha_storage / rates.storage_fetch
    hot = (rates.storage_round_trip / batch + pool * storage_cost) / (host_cost + storage_cost)
    return float("inf") if hot >= pool else hot / (pool - hot)


def predicted_times(rates: Throughputs, hot: int, cold: int, alpha_host: float, alpha_storage: float,
                    batch: int = 1) -> tuple[float, float]:
    """(T_CPU, T_storage) in seconds for one layer and sequence (the round trip shared by the batch)."""
    round_trip = rates.storage_round_trip / batch if cold else 0.0
    return (hot / rates.host_score + alpha_host * hot / rates.host_fetch,
            round_trip + cold / rates.storage_score + alpha_storage * cold / rates.storage_fetch)


@dataclass(frozen=True)
class Plan:
    hot_tokens: int
    beta: float  # the balanced (or given) beta before the host-memory cap; inf: everything hot
    alpha_host: float
    alpha_storage: float
    capped: bool  # Mc was limited by M0

    @property
    def beta_for_json(self) -> float | str:
        """`beta` as results record it: JSON has no infinity, so "everything hot" is the string "inf"."""
        return self.beta if math.isfinite(self.beta) else "inf"


def plan_split(importance: np.ndarray, alpha: float, max_hot: int, rates: Throughputs | None,
               beta: float | None) -> Plan:
    """Hot tokens per sequence for a pool scored by `importance` [batch, pool]."""
    batch, pool = importance.shape
    alpha_host = alpha_storage = alpha
    if beta is None:
        for _ in range(SKEW_ITERATIONS):
            beta = balanced_beta(rates, alpha_host, alpha_storage, pool, batch)
            hot = _hot_tokens(beta, pool, max_hot)
            alpha_host, alpha_storage = _selection_rates(importance, alpha, hot)
    hot = _hot_tokens(beta, pool, max_hot)
    plan = Plan(hot, beta, alpha_host, alpha_storage, capped=hot < _hot_tokens(beta, pool, pool))
    log.info("APP: beta %.3g%s -> %d hot / %d cold tokens per layer (alpha_c %.3f, alpha_s %.3f)", beta,
             " (capped by the host budget)" if plan.capped else "", hot, pool - hot, alpha_host, alpha_storage)
    return plan


def _hot_tokens(beta: float, pool: int, max_hot: int) -> int:
    share = 1.0 if beta == float("inf") else beta / (1 + beta)
    return int(min(max_hot, pool, round(share * pool)))


def _selection_rates(importance: np.ndarray, alpha: float, hot_tokens: int) -> tuple[float, float]:
    """Share of each pool that falls in the prompt's top-alpha set when the hottest `hot_tokens` are hot."""
    pool = importance.shape[1]
    top = int(np.ceil(alpha * pool))
    hot_index, cold_index = split_hot_cold(importance, hot_tokens)
    ranks = np.argsort(np.argsort(-importance, axis=1, kind="stable"), axis=1)
    in_top_hot = (np.take_along_axis(ranks, hot_index, axis=1) < top).sum()
    in_top_cold = (np.take_along_axis(ranks, cold_index, axis=1) < top).sum()
    batch = importance.shape[0]
    alpha_host = in_top_hot / (batch * hot_tokens) if hot_tokens else alpha
    alpha_storage = in_top_cold / (batch * (pool - hot_tokens)) if pool > hot_tokens else alpha
    return float(alpha_host), float(alpha_storage)


# ----- calibration -----

def calibration_key(directory: str, heads: int, head_dim: int, dtype: torch.dtype, bits: int, aggregation: str,
                    block_tokens: int) -> str:
    return (f"{platform.node()}|cpus{os.cpu_count()}|threads{torch.get_num_threads()}|dev{os.stat(directory).st_dev}|"
            f"{heads}x{head_dim}|{str(dtype).removeprefix('torch.')}|int{bits}|{aggregation}|block{block_tokens}|"
            f"v{CALIBRATION_VERSION}")


def load_or_calibrate(directory: str, heads: int, head_dim: int, dtype: torch.dtype, bits: int, aggregation: str,
                      refresh: bool = False, block_tokens: int = SparseSettings.score_block_tokens) -> Throughputs:
    """Cached throughputs for this machine, geometry and the layer step's torch threads, measuring them first
    when missing or `refresh`.

    `block_tokens`: the scorer's score-block size, which sets its per-block overhead (settings.py).
    """
    path = cache_dir() / "sparse-calibration.json"
    with torch_threads(LAYER_STEP_THREADS):
        key = calibration_key(directory, heads, head_dim, dtype, bits, aggregation, block_tokens)
        cached = json.loads(path.read_text()) if path.is_file() else {}
        if key in cached and not refresh:
            return Throughputs(**cached[key])
        rates = calibrate(directory, heads, head_dim, dtype, bits, aggregation, block_tokens=block_tokens)
    cached[key] = asdict(rates)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cached, indent=1))
    log.info("APP calibration for %s: %s", key, rates)
    return rates


def calibrate(directory: str, heads: int, head_dim: int, dtype: torch.dtype, bits: int, aggregation: str,
              tokens: int = CALIBRATION_TOKENS, alpha: float = 0.2,
              block_tokens: int = SparseSettings.score_block_tokens) -> Throughputs:
    """Measure f_c, f_s, B_c, B_s (tokens/s) with the real hot pool, cold pool and scorer process."""
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(1, heads, tokens, head_dim, generator=generator).to(dtype)
    query = torch.randn(1, heads, 1, head_dim, generator=generator)
    picks = np.sort(np.random.default_rng(0).choice(tokens, int(alpha * tokens), replace=False))
    hot = HotPool(1, heads, head_dim, dtype)
    hot.append(keys, keys, np.arange(tokens)[None, :])
    host_score = tokens / _median_time(lambda: hot.score(query, aggregation))
    host_fetch = len(picks) / _median_time(_gather_values(hot, picks))
    fmt = SketchFormat.for_keys(bits, heads, head_dim)
    channel = Channel.create(ChannelSpec(1, 1, heads, 1, head_dim, tokens, kv_record_bytes(heads, head_dim, dtype)))
    with IOEngine(4) as io, tempfile.TemporaryDirectory(dir=directory) as scratch:
        cold = ColdPool(scratch, 1, 1, tokens, heads, head_dim, dtype, fmt, io, channel)
        scorer = None
        try:
            cold.append(0, keys, keys, np.arange(tokens)[None, :])
            scorer = ScorerClient(channel, cold.sketches.path, cold.sketches.layout, fmt, aggregation, block_tokens)
            # After each answer the scorer prepares the next layer: the round trip is timed after that, as a
            # decode's host work hides it; the scan is timed on sketches the scorer must read first (the layer
            # marked rewritten), since f_s is the scorer's whole work per token, which bounds it once the
            # scorer is the slower side (as it is at batch 8).
            request = lambda count: (scorer.request(0, query.numpy(), count), scorer.scores())  # noqa: E731
            round_trip = _median_time(lambda: request(1), repeats=9, pause_s=PREPARE_PAUSE_S)
            scan = _median_time(lambda: _reread(channel, request, tokens), pause_s=PREPARE_PAUSE_S) - round_trip
            storage_score = tokens / max(scan, 1e-9)
            storage_fetch = len(picks) / _median_time(lambda: cold.fetch(0, 0, picks))
        finally:
            if scorer is not None:
                scorer.close()
            cold.close()
            channel.close()
    return Throughputs(host_score, storage_score, host_fetch, storage_fetch, round_trip)


def _reread(channel: Channel, request, tokens: int) -> None:
    """A scorer request for layer 0 whose sketches it must read again: the layer is marked rewritten."""
    channel.versions[0] += 1
    request(tokens)


def _gather_values(hot: HotPool, picks: np.ndarray):
    """The hot fetch of a decode step (selection.py): the picked values read for the weighted sum, in place where the
    kernel takes them, else copied out; their logits are the scores already made."""
    if not weighs_in_place(hot.values, group=1):
        index = torch.from_numpy(picks)
        return lambda: hot.values[0].index_select(1, index)
    weights = torch.full((1, hot.values.shape[1], 1, len(picks)), 1.0 / len(picks))
    segment = PooledSegment(weights, hot.values, picks[None], picks[None], np.array([len(picks)]))
    return lambda: segment.weighted(weights, 0)


def _median_time(action, repeats: int = 5, pause_s: float = 0.0) -> float:
    times = []
    for _ in range(repeats):
        time.sleep(pause_s)
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]
