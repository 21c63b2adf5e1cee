"""Closed-loop streaming clients for `kvtier bench http`, light enough to run in a process of their own.

c clients share one queue of prompts; each streams a completion, and sends the next prompt once
the previous stream ended. Only httpx and the standard library are imported here, so the
benchmark's client process starts fast and takes no interpreter time from the server's.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx


@dataclass
class LevelRun:
    """One level's run through the server: throughput and the latency samples behind its percentiles."""

    tokens: int
    wall_s: float
    ttft_s: list[float]
    itl_s: list[float]
    texts: list[str]  # each prompt's completion, in prompt order

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


async def _stream_one(http: httpx.AsyncClient, model: str, prompt: str, new_tokens: int, fields: dict
                      ) -> tuple[int, float, list[float], str]:
    """(completion tokens, time to first text, gaps between text chunks, text) of one streamed completion; `fields`
    are added to its body (greedy unless they say otherwise)."""
    body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}} | fields
    sent = time.perf_counter()
    arrivals, tokens, pieces = [], 0, []
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk["choices"] and chunk["choices"][0]["text"]:
                arrivals.append(time.perf_counter())
                pieces.append(chunk["choices"][0]["text"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    gaps = [later - earlier for earlier, later in zip(arrivals, arrivals[1:])]
    first = arrivals[0] if arrivals else time.perf_counter()  # no visible text at all (e.g. only a newline)
    return tokens, first - sent, gaps, "".join(pieces)


async def _drive(url: str, model: str, prompts: list[str], clients: int, new_tokens: int, fields: dict) -> LevelRun:
    queue = list(reversed(list(enumerate(prompts))))
    results: dict[int, tuple[int, float, list[float], str]] = {}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def client(http: httpx.AsyncClient) -> None:
        while queue:
            index, prompt = queue.pop()
            results[index] = await _stream_one(http, model, prompt, new_tokens, fields)

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=None) as http:
        started = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        wall = time.perf_counter() - started
    ordered = [results[index] for index in range(len(prompts))]
    return LevelRun(sum(run[0] for run in ordered), wall, [run[1] for run in ordered],
                    [gap for run in ordered for gap in run[2]], [run[3] for run in ordered])


def drive(url: str, model: str, prompts: list[str], clients: int, new_tokens: int, fields: dict | None = None
          ) -> LevelRun:
    """Stream every prompt through the server at `url` with `clients` concurrent clients, `fields` added to each
    request's body."""
    return asyncio.run(_drive(url, model, prompts, clients, new_tokens, fields or {}))
