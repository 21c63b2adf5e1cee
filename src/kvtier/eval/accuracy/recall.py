"""How well a token-importance estimate finds the tokens exact attention cares about.

Ground truth for one decode query of one layer: the attention probability
each token receives, softmax(q.k / sqrt(d)) per query head, summed over heads;
the exact top-k is the k tokens with the most mass. An estimate (GQA
aggregation x sketch precision) selects its own top-k; we report

    recall       |selected & exact top-k| / k
    mass_recall  attention mass on the selected tokens / mass on the exact top-k

`shortlisted` models the path's own choice: the sketches draw up a shortlist,
exact scores choose within it. Used by `kvtier bench sparse` to choose the
head aggregation (summed group queries vs max over heads) and to compare INT8
with INT4, and (`edge_mass`) to size the always-kept sink and recent windows:
the share of attention mass that lands on the first and on the last tokens.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kvtier.sparse.cold.sketch import SCORE_BITS, SketchFormat, quantize, score

ESTIMATES = [(aggregation, bits) for aggregation in ("sum", "max") for bits in (None, *SCORE_BITS)]  # None: full precision


def exact_mass(query: torch.Tensor, keys: torch.Tensor, scaling: float) -> np.ndarray:
    """Attention mass [N] per token of query [Hq, D] over un-repeated keys [Hkv, N, D]."""
    group = query.shape[0] // keys.shape[0]
    grouped = query.float().reshape(keys.shape[0], group, -1)
    probabilities = (torch.matmul(grouped, keys.float().transpose(1, 2)) * scaling).softmax(dim=-1)
    return probabilities.sum(dim=(0, 1)).numpy()


def estimate(query: torch.Tensor, keys: torch.Tensor, aggregation: str, bits: int | None) -> np.ndarray:
    """Importance [N] of keys [Hkv, N, D] as the sparse path computes it (raw inner products)."""
    heads, _, head_dim = keys.shape
    grouped = query.float().reshape(heads, -1, head_dim)
    q = grouped.sum(dim=1, keepdim=True) if aggregation == "sum" else grouped
    if bits is None:
        dots = torch.matmul(q, keys.float().transpose(1, 2)).flatten(0, 1)  # [H*Q, N]
        return (dots.sum(dim=0) if aggregation == "sum" else dots.amax(dim=0)).numpy()
    fmt = SketchFormat.for_keys(bits, heads, head_dim)
    records = quantize(keys.float().transpose(0, 1).numpy(), fmt)
    return score(records, q.numpy(), fmt, aggregation)


def shortlisted(importance: np.ndarray, exact: np.ndarray, k: int, margin: float) -> np.ndarray:
    """What the sparse path chooses by, as an importance: the `exact` one over the ceil(margin x k) tokens that
    `importance` ranks best, -inf over the rest (selection.py's shortlist, all of the pool taken as cold)."""
    shortlist = np.argsort(-importance, kind="stable")[: math.ceil(margin * k)]
    chosen = np.full(importance.shape, -np.inf, dtype=np.float64)
    chosen[shortlist] = exact[shortlist]
    return chosen


def recall_at(mass: np.ndarray, importance: np.ndarray, k: int) -> tuple[float, float]:
    """(recall, mass_recall) of the top-k by `importance` against the top-k by `mass`."""
    exact = np.argsort(-mass, kind="stable")[:k]
    chosen = np.argsort(-importance, kind="stable")[:k]
    return len(np.intersect1d(exact, chosen)) / k, float(mass[chosen].sum() / mass[exact].sum())


def edge_mass(mass: np.ndarray, first: int, last: int) -> float:
    """Share of the total attention mass on the first `first` and the last `last` tokens (disjoint)."""
    tokens = len(mass)
    first = min(first, tokens)
    last = min(last, tokens - first)
    return float((mass[:first].sum() + mass[tokens - last :].sum()) / mass.sum()) if last else float(mass[:first].sum() / mass.sum())
