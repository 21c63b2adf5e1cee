"""What the sampler does to logit rows before it picks tokens: batched tensor operations, as vLLM's sampler does them.

Each function changes the rows it is given in place and leaves every other row alone, so a
request's tokens never depend on what shares its batch. Order (vLLM's): `suppress` (min_tokens),
`add_bias`, `penalize`, then the grammar mask (grammar.py); for sampled rows only, after the
temperature: `draw` or `draw_top_k` (min_p, top-k, top-p, then one uniform number per row placed in
the row's cumulative distribution). On a CPU each full pass over a [64, 49152] step costs
milliseconds, so they touch as little as they can: penalties only the tokens seen, top-k rows only
their k candidates, min_p compares logits (p < min_p x p_max is l < l_max + log min_p).
"""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence

TOP_P_CANDIDATES = 1024  # where a row's top-p set is looked for before its whole vocabulary is sorted


def suppress(logits: torch.Tensor, rows: list[int], tokens: list[int]) -> None:
    """logits[rows[i], tokens[i]] = -inf: those tokens cannot be chosen."""
    if rows:
        logits[torch.tensor(rows), torch.tensor(tokens)] = -torch.inf


def add_bias(logits: torch.Tensor, rows: list[int], tokens: list[int], biases: list[float]) -> None:
    """logits[rows[i], tokens[i]] += biases[i] (OpenAI's logit_bias)."""
    if rows:
        logits.index_put_((torch.tensor(rows), torch.tensor(tokens)), torch.tensor(biases, dtype=logits.dtype),
                          accumulate=True)


def penalize(logits: torch.Tensor, rows: list[int], prompts: list[torch.Tensor], outputs: list[torch.Tensor],
             repetition: list[float], presence: list[float], frequency: list[float]) -> None:
    """vLLM's `apply_penalties` on `rows`: `prompts[i]` / `outputs[i]` are the token ids of row i's sequence.

    The repetition penalty divides a positive logit (multiplies a negative one) of every token seen
    in the prompt or the output; presence subtracts once per token seen in the output, frequency once
    per occurrence there (OpenAI's definitions). Only the seen tokens' logits are read and written
    (a few hundred a row, against a vocabulary of tens of thousands).
    """
    if not rows:
        return
    vocab = logits.shape[1]
    counts = _counts(outputs, vocab)
    row, token = ((counts > 0) | (_counts(prompts, vocab) > 0)).nonzero(as_tuple=True)
    where = (torch.tensor(rows)[row], token)
    values = logits[where]
    penalty = torch.tensor(repetition)[row]
    values = torch.where(values > 0, values / penalty, values * penalty)
    seen = counts[row, token]
    values -= torch.tensor(frequency)[row] * seen + torch.tensor(presence)[row] * (seen > 0)
    logits[where] = values


def _counts(sequences: list[torch.Tensor], vocab: int) -> torch.Tensor:
    """[len(sequences), vocab] occurrences of each token id (padding lands in a dropped column)."""
    padded = pad_sequence([ids.long() for ids in sequences], batch_first=True, padding_value=vocab)
    counts = torch.zeros(len(sequences), vocab + 1)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]


def draw(logits: torch.Tensor, min_p: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor,
         candidates: int = TOP_P_CANDIDATES) -> torch.Tensor:
    """One token per row of `logits` (already divided by the temperature), within `min_p` and `top_p` (0 and 1:
    no limit), where `uniforms` (U[0, 1), one a row) falls in the row's distribution.

    A top-p set is looked for among the row's `candidates` most likely tokens first: where they hold
    the mass, the set is among them and nothing else is sorted (exact either way; a full sort of the
    vocabulary per row is the slow part on a CPU).
    """
    if bool((min_p > 0).any()):
        logits.masked_fill_(logits < logits.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None], -torch.inf)
    probs = torch.softmax(logits, dim=-1)
    nucleus = top_p < 1
    tokens = torch.empty(len(probs), dtype=torch.long)
    if bool((~nucleus).any()):
        tokens[~nucleus] = _inverse_cdf(probs[~nucleus], uniforms[~nucleus])
    if bool(nucleus.any()):
        tokens[nucleus] = _draw_nucleus(probs[nucleus], top_p[nucleus], uniforms[nucleus], candidates)
    return tokens


def _draw_nucleus(probs: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor, candidates: int) -> torch.Tensor:
    values, ids = probs.topk(min(candidates, probs.shape[1]), dim=-1)  # most likely first
    covered = values.sum(dim=-1) >= top_p
    tokens = torch.empty(len(probs), dtype=torch.long)
    for rows, (ordered, order) in ((covered, (values[covered], ids[covered])),
                                   (~covered, probs[~covered].sort(dim=-1, descending=True))):
        if bool(rows.any()):
            ordered = ordered.masked_fill(ordered.cumsum(dim=-1) - ordered >= top_p[rows][:, None], 0)
            tokens[rows] = order.gather(1, _inverse_cdf(ordered, uniforms[rows])[:, None])[:, 0]
    return tokens


def draw_top_k(logits: torch.Tensor, top_k: torch.Tensor, min_p: torch.Tensor, top_p: torch.Tensor,
               uniforms: torch.Tensor) -> torch.Tensor:
    """`draw` for rows that keep their `top_k` (>= 1) most likely tokens only: the rest of the work runs on those
    k candidates, not on the whole vocabulary (vLLM's order: min_p, then top-k, then top-p)."""
    values, ids = logits.topk(int(top_k.clamp(max=logits.shape[1]).max()), dim=-1)  # most likely first
    values.masked_fill_(torch.arange(values.shape[1])[None] >= top_k[:, None], -torch.inf)
    values.masked_fill_(values < values[:, :1] + torch.log(min_p)[:, None], -torch.inf)  # min_p: against the top one
    _keep_top_p(values, top_p)
    return ids.gather(1, _inverse_cdf(torch.softmax(values, dim=-1), uniforms)[:, None])[:, 0]


def _keep_top_p(ordered: torch.Tensor, top_p: torch.Tensor) -> None:
    """On logits sorted most likely first: drop every token after the smallest set reaching `top_p` of the mass."""
    probs = torch.softmax(ordered, dim=-1)
    ordered.masked_fill_(probs.cumsum(dim=-1) - probs >= top_p[:, None], -torch.inf)


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the index where uniforms[row] x the row's mass falls in its cumulative distribution."""
    cumulative = probs.cumsum(dim=-1)
    picks = torch.searchsorted(cumulative, (uniforms * cumulative[:, -1])[:, None], right=True)[:, 0]
    picks = picks.clamp(max=probs.shape[1] - 1)
    # float rounding can land past a row's last possible token: take its most likely one then
    stray = probs.gather(1, picks[:, None])[:, 0] == 0
    return torch.where(stray, probs.argmax(dim=-1), picks)
