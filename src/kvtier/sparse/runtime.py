"""SparseRuntime: what the tiered layers of one SparseCache share.

The cold pool's files, the shared channel and the storage scorer process
(through its client, the layers' one seam to the cold tier), the migration
policy and what its promotions cost, APP's plan and rates, the step statistics, and the query shapes the
scorer and the hot pool score with. A layer keeps its own references to the few its decode step works with
(settings, cold pool, scorer, lookahead, statistics).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kvtier.sparse.cold.cold_image import KV, SKETCH, ColdImage, image_key
from kvtier.sparse.cold.cold_pool import ColdPool, kv_record_bytes
from kvtier.sparse.lookahead import Lookahead, candidate_capacity
from kvtier.sparse.hot.migration import make_policy
from kvtier.sparse.planner import Plan, Throughputs, load_or_calibrate, plan_split, predicted_times
from kvtier.sparse.hot.promotion_price import PromotionPrice
from kvtier.sparse.protocol import CONTROL_CANDIDATE_READ_BYTES, CONTROL_SCORER_READ_BYTES, Channel, ChannelSpec
from kvtier.sparse.scorer.client import ScorerClient
from kvtier.sparse.settings import SparseSettings
from kvtier.sparse.cold.sketch import SketchFormat
from kvtier.sparse.stats import SparseStats
from kvtier.storage import IOEngine, IOStats


class SparseRuntime:
    """What the tiered layers of one SparseCache share: pools' files, scorer, policy, plan, stats."""

    def __init__(self, settings: SparseSettings, max_tokens: int, batch: int, heads: int, q_heads: int,
                 head_dim: int, dtype: torch.dtype, tiered: int, storage_dir: str, max_hot_tokens: int,
                 io_threads: int, entry_dir: Path | None = None, image_tokens: int = 0) -> None:
        """`entry_dir`: the document store entry holding the first `image_tokens` prompt tokens; its sparse image
        for these settings (cold_image.py), if it holds one, is used in place."""
        self.settings = settings
        self.tiered, self.batch = tiered, batch
        self.max_tokens = max_tokens
        self.max_hot_tokens = max_hot_tokens
        self.storage_dir = storage_dir
        self.heads, self.group, self.head_dim, self.dtype = heads, q_heads // heads, head_dim, dtype
        self.promotion_price = PromotionPrice()
        self.policy = make_policy(settings.policy, settings.max_moves, settings.promote_hits, settings.idle_steps,
                                  self.promotion_price)
        self.stats = SparseStats()
        self.plan: Plan | None = None
        self.on_attend: Callable[[int, np.ndarray], None] | None = None  # see SparseCache.watch_attended
        self.on_mass: Callable[[int, np.ndarray], None] | None = None  # see SparseCache.watch_mass
        self.rates: Throughputs | None = None
        q_per_head = 1 if settings.aggregation == "sum" else self.group
        candidates = candidate_capacity(settings.most_share, settings.candidate_margin, max_tokens) \
            if settings.lookahead else 0
        self.channel = Channel.create(ChannelSpec(batch, tiered, heads, q_per_head, head_dim, max_tokens,
                                                  kv_record_bytes(heads, head_dim, dtype), candidates))
        self.io = IOEngine(io_threads)
        self.stored_io: IOEngine | None = None
        self.fmt = SketchFormat.for_keys(settings.score_bits, heads, head_dim)
        self.cold: ColdPool | None = None
        self.scorer: ScorerClient | None = None
        self.lookahead: Lookahead | None = None  # set by make_sparse_cache, which has the model, before the layers
        try:
            self.image = ColdImage.open(entry_dir, image_key(self), image_tokens) if entry_dir is not None else None
            if self.image is not None:
                self.plan = Plan(**self.image.plan)
                # the image's reads get an engine of their own: a fetch has one batch in flight on each file at once
                self.stored_io = IOEngine(io_threads)
            self.cold = ColdPool(storage_dir, tiered, batch, max_tokens, heads, head_dim, dtype, self.fmt, self.io,
                                 self.channel, self.image.kv_file(self.stored_io) if self.image is not None else None)
            self.scorer = ScorerClient(self.channel, self.cold.sketches.path, self.cold.sketches.layout, self.fmt,
                                       settings.aggregation, settings.score_block_tokens, settings.scorer_io_threads,
                                       settings.scorer_memory_budget,
                                       crash_after_blocks=settings.crash_scorer_after_blocks,
                                       kv={"path": self.cold.kv.path, "layout": self.cold.kv.layout.to_dict(),
                                           "page": self.cold.kv.page},
                                       stored=self.image.scorer_config(SKETCH) if self.image is not None else None,
                                       stored_kv=self.image.scorer_config(KV) if self.image is not None else None)
        except BaseException:
            self.close()
            raise

    @property
    def hot_tokens(self) -> int:
        """Planned hot-pool size per layer and sequence (0 before the first layer is distributed)."""
        return self.plan.hot_tokens if self.plan is not None else 0

    def hot_tokens_for(self, importance: np.ndarray) -> int:
        """Hot tokens for a pool with this importance; planned once (by APP) on the first layer."""
        if self.plan is None:
            if self.settings.beta is None:
                self.rates = load_or_calibrate(self.storage_dir, self.heads, self.head_dim, self.dtype,
                                               self.settings.score_bits, self.settings.aggregation,
                                               block_tokens=self.settings.score_block_tokens)
            self.plan = plan_split(importance, self.settings.alpha, self.max_hot_tokens, self.rates,
                                   self.settings.beta)
        return min(self.plan.hot_tokens, importance.shape[1])

    def grouped_query(self, query: torch.Tensor) -> torch.Tensor:
        """A decode query [B, Hq, 1, D] as float32 [B, Hkv, G, D] on the host (G query heads per KV head)."""
        return query[:, :, 0].float().cpu().reshape(query.shape[0], self.heads, self.group, query.shape[-1])

    def score_query(self, grouped: torch.Tensor) -> torch.Tensor:
        """What the scorer scores with, [B, Hkv, Q, D], from `grouped_query`'s [B, Hkv, G, D].

        "sum": Q = 1, the group's query heads summed (one dot product per KV head);
        "max": Q = G, every query head kept.
        """
        return grouped.sum(dim=2, keepdim=True) if self.settings.aggregation == "sum" else grouped

    def predict_step(self, hot: int, cold: int, batch: int) -> tuple[float, float]:
        """APP's (T_CPU, T_storage) for one layer and sequence of `batch` (0, 0 without calibrated rates)."""
        if self.rates is None or self.plan is None:
            return 0.0, 0.0
        return predicted_times(self.rates, hot, cold, self.plan.alpha_host, self.plan.alpha_storage, batch)

    def io_stats(self) -> IOStats:
        """Disk bytes moved by the host (writes, K/V fetches) and by the scorer (sketch and candidate reads)."""
        stats = self.io.stats.snapshot()
        stats.bytes_read += int(self.channel.control[CONTROL_SCORER_READ_BYTES] +
                                self.channel.control[CONTROL_CANDIDATE_READ_BYTES])
        if self.stored_io is not None:
            stats.bytes_read += self.stored_io.stats.snapshot().bytes_read
        return stats

    def close(self) -> None:
        lookahead, self.lookahead = self.lookahead, None
        try:
            if lookahead is not None:
                lookahead.close()  # waits for candidates in flight: the scorer reads the cold pool's files
        finally:
            self._close_tiers()

    def _close_tiers(self) -> None:
        if self.scorer is not None:
            self.scorer.close()
            self.scorer = None
        if self.cold is not None:
            self.cold.close()
            self.cold = None
        self.io.close()
        if self.stored_io is not None:
            self.stored_io.close()
        self.channel.close()
