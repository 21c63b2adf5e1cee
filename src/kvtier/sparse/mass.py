"""The attention mass a selection keeps, estimated per decode step, and the top-p budget that chooses by it.

A decode step attends the window plus a choice of pooled tokens. The share of the softmax's mass those tokens
hold is, per query head h, sum over the attended j of exp(s l_hj) / Z_h, with Z_h summed over *every* token of
the layer; the step's figure is its mean over the query heads (as `bench accuracy`'s attention-mass recall
measures it against a dense cache). The host knows most terms exactly: the window's logits, the hot pool's q.k
(the hot scores are the logits) and the cold candidates' q.k once read. The cold tokens not read are known only
by their sketch scores, a token's importance summed (or maxed) over the query heads: each is taken to have the
mean logit l = importance / query heads ("sum"; "max": the importance itself) in every head. That is the one
estimate in the figure; with every cold token read it is exact. By Jensen's inequality the mean logit
underweighs a token whose heads disagree, so the estimate leans high when unread tokens matter
(`bench accuracy` measures the error).

The top-p budget (Twilight's answer to a fixed top-k, "Twilight: Adaptive Attention Sparsity with Hierarchical
Top-p Pruning") keeps, per sequence, the smallest set of scored tokens whose estimated mass, with the window's,
reaches P: the tokens by falling mass, as many as the running sum needs. The count is clamped between a floor
and a ceiling share of the pooled tokens. The guard: where the mass at that count is still under `guard` (the
scores too flat for the ceiling to hold P), the ceiling is lifted and the step takes as many as reaching P needs,
up to all it scored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class TopP:
    """A top-p budget: mass `p` to keep, count between `floor` and `ceiling` shares of the pooled tokens, `guard`
    the estimated mass under which the ceiling is lifted."""

    p: float
    floor: float
    ceiling: float
    guard: float

    @classmethod
    def of(cls, settings) -> TopP | None:
        """The budget of SparseSettings `settings`, or None where they attend the fixed share alpha."""
        if settings.top_p is None:
            return None
        return cls(settings.top_p, settings.min_share, settings.max_share, settings.guard_mass)

    def counts(self, window_mass: np.ndarray, masses: np.ndarray, pooled: int) -> tuple[np.ndarray, np.ndarray]:
        """Per sequence, how many of its scored tokens to keep, and whether the guard lifted the ceiling.

        Args:
            window_mass: [B] the window's estimated mass (always attended).
            masses: [B, n] each scored token's estimated mass (padding: -inf or 0).
            pooled: the pool's tokens per sequence, of which floor and ceiling are shares (n may be fewer).
        Returns:
            int64 [B] counts (0 to n), bool [B] guard events.
        """
        scored = np.isfinite(masses).sum(axis=1).tolist()  # per sequence: the padding is no token
        running = window_mass[:, None] + np.cumsum(np.sort(np.maximum(masses, 0.0), axis=1)[:, ::-1], axis=1)
        below = (running < self.p).sum(axis=1).tolist()  # by falling mass, the sum grows: the count short of P
        floor = math.ceil(self.floor * pooled)
        ceiling = max(math.ceil(self.ceiling * pooled), floor)
        counts, guarded = [], []
        for row, (tokens, short) in enumerate(zip(scored, below)):  # a few sequences: per-op costs dominate
            reaching = min(short + 1, tokens)
            clamped = min(max(reaching, min(floor, tokens)), min(ceiling, tokens))
            kept = running[row, clamped - 1] if clamped > 0 else window_mass[row]
            guarded.append(bool(kept < self.guard) and reaching > clamped)
            counts.append(reaching if guarded[-1] else clamped)
        return np.array(counts, dtype=np.int64), np.array(guarded, dtype=bool)


def estimate(exact: list[torch.Tensor], unread: np.ndarray | None, scaling: float, softcap: float | None,
             aggregation: str) -> tuple[list[np.ndarray], torch.Tensor]:
    """Each token's mass, the mean over query heads, for every part of `exact` (raw logits [B, Hkv, G, n_i]; -inf:
    no token, mass 0) -> [B, n_i] each; and log Z per sequence and query head [B, Hkv, G], Z summed over those
    parts and the unread cold tokens' sketch scores `unread` [B, m] (-inf: read or no token) at their mean logit.
    The parts are joined into one new tensor (the callers' are left as they are), so that each step below is one
    op over every logit: the decode step makes this call per layer and sequence, and per-op costs dominated."""
    sizes = [part.shape[3] for part in exact]
    logits = _scaled_in_place(torch.cat([part.float() for part in exact], dim=3), scaling, softcap)
    batch, kv_heads, group, _ = logits.shape
    heads = kv_heads * group
    flat = logits.view(batch, heads, -1)
    peak = flat.amax(dim=2, keepdim=True)
    exps = flat.sub_(peak).exp_()
    log_z = exps.sum(dim=2, keepdim=True).log_().add_(peak)
    if unread is not None and unread.shape[1]:
        sketch = _scaled_in_place(torch.from_numpy(_mean_logits(unread, heads, aggregation)), scaling, softcap)
        log_z = torch.logaddexp(log_z, torch.logsumexp(sketch, dim=1)[:, None, None])
    share = peak.sub_(log_z).exp_().div_(heads)  # exp(peak) / Z per head, its share of the mean over the heads
    masses = torch.bmm(share.transpose(1, 2), exps)[:, 0].numpy()  # [B, n]: sum over heads of exps x share
    return np.split(masses, np.cumsum(sizes)[:-1], axis=1), log_z.view(batch, kv_heads, group)


def sketch_mass(scores: np.ndarray, log_z: torch.Tensor, scaling: float, softcap: float | None,
                aggregation: str) -> np.ndarray:
    """Each cold token's estimated mass [B, m] from its sketch score [B, m], at its mean logit in every head."""
    heads = log_z.shape[1] * log_z.shape[2]
    logits = _scaled_in_place(torch.from_numpy(_mean_logits(scores, heads, aggregation)), scaling, softcap)
    per_head = torch.logsumexp(-log_z.flatten(1), dim=1) - math.log(heads)  # log mean over heads of 1 / Z_h
    return logits.add_(per_head[:, None]).exp_().numpy()


def _mean_logits(scores: np.ndarray, heads: int, aggregation: str) -> np.ndarray:
    """A token's logit in each head, estimated from its importance over the `heads` query heads."""
    scores = np.ascontiguousarray(scores, dtype=np.float32)
    return scores / heads if aggregation == "sum" else scores.copy()


def _scaled_in_place(logits: torch.Tensor, scaling: float, softcap: float | None) -> torch.Tensor:
    """The attention's logits from raw q.k `logits` (float32, overwritten): the scaling, then the softcap where the
    model has one."""
    logits.mul_(scaling)
    return logits.div_(softcap).tanh_().mul_(softcap) if softcap else logits
