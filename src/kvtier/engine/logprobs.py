"""Log-probabilities of chosen tokens and of their most likely alternatives, from logit rows.

They are of the model's raw distribution, log_softmax of the logits as the model gave them: before
temperature, penalties, `logit_bias` and grammar masks, as vLLM reports them by default
(`logprobs_mode="raw_logprobs"`). So a token's log-probability does not depend on how it was sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprobs:
    """One position: the token there, its log-probability, and the `k` most likely tokens (most likely first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprobs(logprobs: torch.Tensor, tokens: list[int], tops: list[int]) -> list[TokenLogprobs]:
    """Row i of `logprobs` [n, vocab] (log_softmax already taken): token `tokens[i]` and its `tops[i]` alternatives."""
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device)[:, None])[:, 0].tolist()
    most = max(tops, default=0)
    values, ids = logprobs.topk(most, dim=-1) if most else (logprobs[:, :0], logprobs[:, :0].long())
    values, ids = values.tolist(), ids.tolist()
    return [TokenLogprobs(token, logprob, tuple(zip(ids[row][:top], values[row][:top])))
            for row, (token, logprob, top) in enumerate(zip(tokens, chosen, tops))]


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax in float32 over the vocabulary."""
    return torch.log_softmax(logits.float(), dim=-1)
