"""The serving engine: `add_request` / `step` for online use, `generate` for offline batches (like vLLM's LLM).

One engine owns a device KV pool, a block manager, a scheduler and one swap
backend chosen by `EngineConfig.swap`:

    flash      HiFC: swap blocks to a pre-created flash cache file (append-only log); from a CPU pool
               with O_DIRECT (flash_swap.py), from a GPU pool with kvikio / GPUDirect Storage (gds_swap.py)
    dram       baseline: swap to a host-DRAM pool of the same slot count (vLLM swap space)
    recompute  baseline: drop a victim's KV and recompute it when resumed

Decoding is greedy unless a request's `SamplingParams` set a temperature
(sampler.py). `step_events` reports every token as it is generated (a server
streams them); `abort` ends a request early and frees its device blocks and swap
slots. A request whose swapped KV fails its checksum is recomputed
from its tokens (the output is unchanged) and the error is kept in its
`warnings`, so a damaged flash file costs time, never a wrong answer.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtier.errors import ConfigError
from kvtier.kv.model_geometry import model_geometry
from kvtier.models.prompts import prompt_ids
from kvtier.paths import cache_dir
from kvtier.engine.block_manager import BlockManager
from kvtier.engine.config import EngineConfig
from kvtier.engine.dram_swap import DramSwap
from kvtier.engine.flash_swap import FlashSwap
from kvtier.engine.gds_swap import GdsFlashSwap
from kvtier.engine.kv_pool import KVPool
from kvtier.engine.model_runner import ModelRunner, ScheduledChunk
from kvtier.engine.sampler import Sampler
from kvtier.engine.scheduler import Scheduler
from kvtier.engine.sequence import SamplingParams, Sequence, Status
from kvtier.engine.swap import SwapBackend
from kvtier.engine.tiered import TierBudgets, TierProvider, Tiers
from kvtier.storage import BlockLayout, KVGeometry
from kvtier.units import format_size, parse_size


@dataclass(frozen=True)
class TokenEvent:
    """One token generated for a request in a step; `output` is set when that token finished it."""

    request_id: int
    token_id: int | None  # None: the request ended without a new token (it could not start: `output` says why)
    output: RequestOutput | None = None
    queue_s: float | None = None  # with a request's first token: its wait from `add_request` to its first forward


@dataclass
class RequestOutput:
    """A finished request: its tokens (and text when the engine has a tokenizer) and what happened to it."""

    request_id: int
    prompt_tokens: int
    token_ids: list[int]
    finish_reason: str
    text: str | None = None
    swap_outs: int = 0
    recomputes: int = 0
    warnings: list[str] = field(default_factory=list)
    tiered: bool = False  # its KV lived in tiers of its own (tiered.py)
    queue_s: float | None = None  # from `add_request` to the first forward that ran it (None: never ran)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class LLMEngine:
    """Continuous-batching greedy generation over a paged KV pool with a swap backend."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig | None = None,
                 encode: Callable[[str], list[int]] | None = None, decode: Callable[[list[int]], str] | None = None,
                 eos_token_ids: Iterable[int] = (), model_id: str = "model", tiers: TierProvider | None = None) -> None:
        """`tiers`: makes the KV of sequences too long for the paged pool (without it they are refused)."""
        self.config = (config or EngineConfig()).validated()
        self.model_id = model_id
        self._encode, self._decode = encode, decode
        self.eos_token_ids = set(eos_token_ids)
        started = time.perf_counter()
        geometry = model_geometry(model)
        self.pool = KVPool(geometry, self._device_blocks(geometry), self.config.block_tokens, model.device)
        self.tiers = self._tiers(tiers, geometry) if tiers is not None else None  # refused before any file exists
        self.swap = self._make_swap()
        self.init_seconds = time.perf_counter() - started
        try:  # from here on the engine owns a file: a failure (or a signal's unwinding) must not leave it behind
            self.block_manager = BlockManager(self.pool.num_blocks, self.config.block_tokens)
            self.scheduler = Scheduler(self.block_manager, self.swap, self.config.max_num_seqs,
                                       self.config.max_batched_tokens, self.tiers)
            self.runner = ModelRunner(model, self.pool)
        except BaseException:
            if self.swap is not None:
                self.swap.close()
            raise
        self.sampler = Sampler()
        self._sequences: dict[int, Sequence] = {}
        self._next_id = 0
        self.forward_tokens = 0

    @classmethod
    def from_llm(cls, llm: Any, config: EngineConfig | None = None, tiers: TierProvider | None = None) -> LLMEngine:
        """An engine for a `kvtier.models.loader.LoadedModel`: chat-templated prompts, text outputs."""
        eos = llm.model.generation_config.eos_token_id
        eos = llm.tokenizer.eos_token_id if eos is None else eos
        return cls(llm.model, config, encode=lambda prompt: prompt_ids(llm, prompt)[0].tolist(),
                   decode=lambda ids: llm.tokenizer.decode(ids, skip_special_tokens=True),
                   eos_token_ids=eos if isinstance(eos, (list, tuple)) else [eos], model_id=llm.model_id,
                   tiers=tiers)

    # ----- requests -----

    def add_request(self, prompt: str | list[int], sampling: SamplingParams | None = None) -> int:
        """Queue a prompt (text needs an engine with a tokenizer, or pass token ids); return its request id."""
        ids = self._prompt_ids(prompt)
        seq = Sequence(self._next_id, ids, sampling or SamplingParams(), arrived_s=time.perf_counter())
        self.scheduler.add(seq)
        self._sequences[seq.request_id] = seq
        self._next_id += 1
        return seq.request_id

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, append the sampled tokens; return the requests that finished."""
        return [event.output for event in self.step_events() if event.output is not None]

    def step_events(self) -> list[TokenEvent]:
        """Like `step`, but report every token generated in this step, in batch order."""
        chunks = self.scheduler.schedule()
        events = [self._failed(seq) for seq in self.scheduler.failed]
        if not chunks:
            return events
        completing = [chunk.seq for chunk in chunks if chunk.completes]
        started = time.perf_counter()
        for chunk in chunks:
            if chunk.seq.started_s is None:
                chunk.seq.started_s = started
        logits = self.runner.run(chunks)
        tokens = self.sampler.choose(logits, [(seq.request_id, seq.sampling) for seq in completing])
        self.forward_tokens += sum(chunk.num_tokens for chunk in chunks)
        lost = {id(seq) for seq in self._drop_lost(chunks, events)}
        for chunk in (chunk for chunk in chunks if id(chunk.seq) not in lost):
            prompt_done = chunk.seq.kv is not None and chunk.completes and not chunk.seq.output_ids
            chunk.seq.num_computed += chunk.num_tokens
            if prompt_done:
                chunk.seq.kv.prompt_done()  # tiers the prompt before its first decode step
        for seq, token in ((seq, token) for seq, token in zip(completing, tokens) if id(seq) not in lost):
            seq.output_ids.append(token)
            reason = self._finish_reason(seq)
            output = None
            if reason:
                seq.finish_reason = reason
                self.scheduler.finish(seq)
                output = self._end(seq.request_id)
            queue_s = seq.started_s - seq.arrived_s if len(seq.output_ids) == 1 else None
            events.append(TokenEvent(seq.request_id, token, output, queue_s))
        return events

    def abort(self, request_id: int) -> RequestOutput | None:
        """End an unfinished request now (finish reason "abort"), freeing its blocks and swap slots.

        Returns its output so far, or None when it already finished (or never existed).
        """
        seq = self._sequences.get(request_id)
        if seq is None:
            return None
        self.scheduler.abort(seq)
        seq.finish_reason = "abort"
        return self._end(request_id)

    def generate(self, prompts: Iterable[str | list[int]], sampling: SamplingParams | None = None,
                 progress: Callable[[RequestOutput], None] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order."""
        ids = [self.add_request(prompt, sampling) for prompt in prompts]
        done: dict[int, RequestOutput] = {}
        while self.has_unfinished():
            for output in self.step():
                done[output.request_id] = output
                if progress is not None:
                    progress(output)
        return [done[request_id] for request_id in ids]

    def stats(self) -> dict[str, Any]:
        """Scheduler counters, swap traffic and allocator statistics so far."""
        report: dict[str, Any] = {"scheduler": self.scheduler.stats.to_dict(), "forward_tokens": self.forward_tokens,
                                  "device_blocks": self.pool.num_blocks, "device_pool_bytes": self.pool.nbytes,
                                  "init_seconds": self.init_seconds}
        if self.swap is not None:
            allocator = self.swap.allocator
            report["swap"] = self.swap.stats.to_dict() | {
                "backend": self.swap.name, "io": self.swap.io_backend, "slots": self.swap.num_slots,
                "appends": allocator.appends, "sequential_appends": allocator.sequential_appends,
                "sequential_share": allocator.sequential_share, "overwrites": allocator.overwrites,
                "reclaimed_segments": getattr(allocator, "reclaimed_segments", 0)}
        return report

    def close(self) -> None:
        self.scheduler.close()
        if self.swap is not None:
            self.swap.close()
        self.runner.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- helpers -----

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self._encode is None:
                raise ConfigError("this engine has no tokenizer: pass prompts as token ids")
            ids = self._encode(prompt)
        else:
            ids = [int(token) for token in prompt]
        if not ids:
            raise ConfigError("empty prompt: give at least one token")
        return ids

    def _drop_lost(self, chunks: list[ScheduledChunk], events: list[TokenEvent]) -> list[Sequence]:
        """Take out the tiered sequences whose KV failed a read in this forward (their rows are meaningless): each is
        recomputed, or ends with the error (reported in `events`)."""
        lost = self.scheduler.drop_lost(chunks)
        events += [self._failed(seq) for seq in lost if seq.status is Status.FINISHED]
        return lost

    def _failed(self, seq: Sequence) -> TokenEvent:
        """A request that could not start or go on (its KV could not be opened or read): it ends now, its error in
        `warnings`."""
        seq.finish_reason = "error"
        return TokenEvent(seq.request_id, None, self._end(seq.request_id))

    def _end(self, request_id: int) -> RequestOutput:
        self.sampler.forget(request_id)
        return self._output(self._sequences.pop(request_id))

    def _finish_reason(self, seq: Sequence) -> str | None:
        if not seq.sampling.ignore_eos and seq.output_ids[-1] in self.eos_token_ids:
            return "stop"
        if len(seq.output_ids) >= seq.sampling.max_new_tokens:
            return "length"
        return None

    def _output(self, seq: Sequence) -> RequestOutput:
        text = self._decode(seq.output_ids) if self._decode is not None else None
        queue_s = None if seq.started_s is None else seq.started_s - seq.arrived_s
        return RequestOutput(seq.request_id, len(seq.prompt_ids), list(seq.output_ids), seq.finish_reason or "",
                             text, seq.swap_outs, seq.recomputes, list(seq.warnings), seq.tiered, queue_s)

    def _device_blocks(self, geometry: KVGeometry) -> int:
        if self.config.device_blocks is not None:
            return self.config.device_blocks
        per_block = _block_bytes(geometry, self.config.block_tokens)
        blocks = parse_size(self.config.device_kv_budget) // per_block
        if blocks < 1:
            raise ConfigError(f"device KV budget {self.config.device_kv_budget} holds no {per_block}-byte block; "
                              "raise it")
        return blocks

    def _tiers(self, provider: TierProvider, geometry: KVGeometry) -> Tiers:
        """Each tiered sequence's budgets: its device window as whole pool blocks, and its share of the host."""
        window_bytes = provider.window_tokens() * geometry.token_bytes
        blocks = -(-window_bytes // _block_bytes(geometry, self.config.block_tokens))
        if blocks > self.pool.num_blocks:
            raise ConfigError(f"device KV budget {format_size(parse_size(self.config.device_kv_budget))} cannot hold "
                              f"a tiered sequence's device window ({blocks} blocks); raise it")
        host_share = parse_size(self.config.host_kv_budget) // self.config.max_tiered_seqs
        provider.check(host_share)
        budgets = TierBudgets(blocks, blocks * _block_bytes(geometry, self.config.block_tokens), host_share)
        return Tiers(provider, budgets, self.config.max_tiered_seqs, self.config.tiered_slice)

    def _make_swap(self) -> SwapBackend | None:
        config = self.config
        if config.swap == "recompute":
            return None
        slots = parse_size(config.swap_space) // _block_bytes(self.pool.geometry, config.block_tokens)
        if slots < 1:
            raise ConfigError(f"swap space {config.swap_space} holds no KV block; raise it")
        if config.swap == "dram":
            return DramSwap(self.pool, slots, config.io_threads)
        backend = flash_backend(self.pool.device)
        return backend(self.pool, self._flash_path(), slots, self.model_id, config.io_threads,
                       config.flash_allocator, config.segment_slots)

    def _flash_path(self) -> str:
        if self.config.flash_path:
            return self.config.flash_path
        directory = cache_dir() / "kv"
        directory.mkdir(parents=True, exist_ok=True)
        safe_id = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.model_id)
        return os.fspath(Path(directory) / f"flash-{safe_id}-{self.config.block_tokens}.kvc")


def flash_backend(device: torch.device) -> type[FlashSwap]:
    """The flash cache's data path for a pool on `device`: O_DIRECT from host memory, or kvikio from a GPU."""
    return GdsFlashSwap if device.type == "cuda" else FlashSwap


def _block_bytes(geometry: KVGeometry, block_tokens: int) -> int:
    """Bytes of one device block over all layers, as laid out in the pool and the flash file."""
    return BlockLayout(geometry, block_tokens, 1).layer_bytes * geometry.num_layers
