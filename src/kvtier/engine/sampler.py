"""Next-token choice per sequence: argmax at temperature 0, else temperature + top-p sampling.

Greedy rows take the argmax of the logits exactly as before sampling existed, so
greedy outputs stay independent of the swap backend and of who shares the batch.
A sampled request owns a `torch.Generator` (seeded by its `seed`, or from the OS),
kept here until the request ends: each generated token draws from it once, so a
request that is preempted and resumed continues the same random stream.
"""

from __future__ import annotations

import torch

from kvtier.engine.sequence import SamplingParams


class Sampler:
    """Chooses tokens from logit rows; holds the random generators of sampled requests."""

    def __init__(self) -> None:
        self._generators: dict[int, torch.Generator] = {}

    def choose(self, logits: torch.Tensor, requests: list[tuple[int, SamplingParams]]) -> list[int]:
        """One token per row of `logits` [n, vocab], row i for `requests[i]` = (request id, sampling)."""
        if all(sampling.greedy for _, sampling in requests):
            return logits.argmax(dim=-1).tolist()
        return [int(row.argmax()) if sampling.greedy else self._draw(row, request_id, sampling)
                for row, (request_id, sampling) in zip(logits, requests)]

    def forget(self, request_id: int) -> None:
        """The request ended: drop its generator."""
        self._generators.pop(request_id, None)

    def _draw(self, row: torch.Tensor, request_id: int, sampling: SamplingParams) -> int:
        probs = torch.softmax(row.float().cpu() / sampling.temperature, dim=-1)  # the generators live on the CPU
        if sampling.top_p < 1:
            probs = _top_p(probs, sampling.top_p)
        return int(torch.multinomial(probs, 1, generator=self._generator(request_id, sampling)))

    def _generator(self, request_id: int, sampling: SamplingParams) -> torch.Generator:
        generator = self._generators.get(request_id)
        if generator is None:
            generator = torch.Generator(device="cpu")
            if sampling.seed is None:
                generator.seed()
            else:
                generator.manual_seed(sampling.seed)
            self._generators[request_id] = generator
        return generator


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the smallest most-probable set whose mass reaches `top_p` (the top token stays)."""
    sorted_probs, order = probs.sort(descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs[mass_before >= top_p] = 0
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
