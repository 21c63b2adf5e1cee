"""What the sampler does to logit rows before it picks tokens: batched tensor operations, as vLLM's sampler does them.

Each function changes the rows it is given in place and leaves every other row alone, so a
request's tokens never depend on what shares its batch. Order (vLLM's): `suppress` (min_tokens),
`add_bias`, `penalize`, then the grammar mask (grammar.py); for sampled rows only, after the
temperature: `keep_min_p`, then `keep_top_k_top_p`.
"""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence


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
    per occurrence there (OpenAI's definitions).
    """
    if not rows:
        return
    index = torch.tensor(rows)
    vocab = logits.shape[1]
    counts = _counts(outputs, vocab)
    seen = (counts > 0) | (_counts(prompts, vocab) > 0)
    part = logits[index]
    penalty = torch.tensor(repetition)[:, None].expand_as(part)
    penalty = torch.where(seen, penalty, torch.ones_like(penalty))
    part = part * torch.where(part > 0, 1 / penalty, penalty)
    part -= torch.tensor(frequency)[:, None] * counts
    part -= torch.tensor(presence)[:, None] * (counts > 0)
    logits[index] = part


def _counts(sequences: list[torch.Tensor], vocab: int) -> torch.Tensor:
    """[len(sequences), vocab] occurrences of each token id (padding lands in a dropped column)."""
    padded = pad_sequence([ids.long() for ids in sequences], batch_first=True, padding_value=vocab)
    counts = torch.zeros(len(sequences), vocab + 1)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]


def keep_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens whose probability is below min_p x the row's top probability (rows with min_p 0 keep all)."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    logits.masked_fill_(probs < threshold, -torch.inf)


def keep_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> None:
    """Keep each row's `top_k` most likely tokens (k >= vocab: all), then the smallest set reaching `top_p` of their
    mass (1: all); the most likely token always stays. Without top_p only a top-k threshold is taken (no full sort)."""
    vocab = logits.shape[1]
    top_k = top_k.clamp(max=vocab)
    if bool((top_p >= 1).all()):
        kth = logits.topk(int(top_k.max()), dim=-1).values.gather(1, (top_k - 1)[:, None])
        logits.masked_fill_(logits < kth, -torch.inf)
        return
    ordered, order = logits.sort(dim=-1, descending=False)
    kth = ordered.gather(1, (vocab - top_k)[:, None])
    ordered.masked_fill_(ordered < kth, -torch.inf)
    cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - top_p)[:, None]
    drop[:, -1] = False
    ordered.masked_fill_(drop, -torch.inf)
    logits.scatter_(1, order, ordered)
