"""The serving engine: `add_request` / `step` for online use, `generate` for offline batches (like vLLM's LLM).

One engine owns a device KV pool, a block manager, a scheduler and one swap
backend chosen by `EngineConfig.swap`:

    flash      HiFC: swap blocks to a pre-created flash cache file (append-only log); from a CPU pool
               with O_DIRECT (swap/flash.py), from a GPU pool with kvikio / GPUDirect Storage (swap/gds.py)
    dram       baseline: swap to a host-DRAM pool of the same slot count (vLLM swap space)
    recompute  baseline: drop a victim's KV and recompute it when resumed

Decoding is greedy unless a request's `SamplingParams` set a temperature; every
step's tokens are chosen by one batched sampler (sampler.py: vLLM's sampling
parameters, log-probabilities, grammars). A request for several choices forks them
from one sequence once its prompt is computed (choices.py). `step_events` reports
every token as it is generated (a server streams them); `abort` ends a request early
and frees its device blocks and swap slots. A request whose swapped KV fails its checksum is recomputed
from its tokens (the output is unchanged) and the error is kept in its
`warnings`, so a damaged flash file costs time, never a wrong answer.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

from kvtier.errors import ConfigError
from kvtier.kv.model_geometry import model_geometry
from kvtier.models.prompts import prompt_ids
from kvtier.paths import cache_dir
from kvtier.engine.block_manager import BlockManager, blocks_for
from kvtier.engine.config import EngineConfig
from kvtier.engine.swap.dram import DramSwap
from kvtier.engine.swap.flash import FlashSwap
from kvtier.engine.swap.gds import GdsFlashSwap
from kvtier.engine.kv_pool import KVPool
from kvtier.engine.choices import Choices
from kvtier.engine.logprobs import TokenLogprobs, raw_logprobs, token_logprobs
from kvtier.engine.model_runner import ModelRunner, ScheduledChunk, StepLogits
from kvtier.engine.outputs import RequestOutput, TokenEvent
from kvtier.engine.sampler import Sampler
from kvtier.engine.scheduler import Scheduler
from kvtier.engine.sequence import SamplingParams, Sequence, Status
from kvtier.engine.swap.backend import SwapBackend
from kvtier.engine.tiered import TierBudgets, TierProvider, Tiers
from kvtier.storage import BlockLayout, KVGeometry
from kvtier.units import format_size, parse_size


class LLMEngine:
    """Continuous-batching generation over a paged KV pool with a swap backend."""

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
        self.sampler = Sampler(tuple(self.eos_token_ids))
        self.choices = Choices(self.scheduler, self.block_manager)
        self._sequences: dict[int, Sequence] = {}
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
        """Queue a prompt (text needs an engine with a tokenizer, or pass token ids); return its request id.

        Its `sampling.n` (or `best_of`) choices are reported under that id with their `index`."""
        ids = self._prompt_ids(prompt)
        sampling = sampling or SamplingParams()
        if sampling.prompt_logprobs is not None and self.tiers is not None and self._tiered(len(ids) + sampling.max_new_tokens):
            raise ConfigError("prompt log-probabilities need the paged path, and this prompt is tiered "
                              "(a stored document's prefix is never run through the model)")
        seq = Sequence(self.choices.new_id(), ids, sampling, arrived_s=time.perf_counter())
        for queued in self.choices.add(seq):
            self._sequences[queued.request_id] = queued
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
        self.pool.copy_blocks(self.block_manager.take_copies())  # copy-on-write of blocks shared by choices
        started = time.perf_counter()
        for chunk in chunks:
            if chunk.seq.started_s is None:
                chunk.seq.started_s = started
        completing = [chunk.seq for chunk in chunks if chunk.completes]
        with self._forwarding(chunks):
            logits = self.runner.run(chunks)
        self.forward_tokens += sum(chunk.num_tokens for chunk in chunks)
        lost = {id(seq) for seq in self._drop_lost(chunks, events)}
        self._computed([chunk for chunk in chunks if id(chunk.seq) not in lost])
        self._score_prompts(logits)
        rows, completing = self._with_forks(completing)
        sampled = self.sampler.choose(logits.sample[rows] if len(rows) > len(logits.sample) else logits.sample, completing)
        for seq, token, logprobs in zip(completing, sampled.tokens, sampled.logprobs):
            if id(seq) not in lost:
                events.append(self._append(seq, token, logprobs))
        return events

    def _forwarding(self, chunks: list[ScheduledChunk]) -> AbstractContextManager:
        """The tier provider's context for a forward in which tiered sequences decode; none otherwise."""
        decoding = sum(chunk.seq.kv is not None and chunk.seq.prompt_computed for chunk in chunks)
        return self.tiers.provider.forwarding(decoding) if decoding else nullcontext()

    def _drop_lost(self, chunks: list[ScheduledChunk], events: list[TokenEvent]) -> list[Sequence]:
        """Take out the tiered sequences whose KV failed a read in this forward (their rows are meaningless): each is
        recomputed, or ends with the error (reported in `events`)."""
        lost = self.scheduler.drop_lost(chunks)
        events += [self._failed(seq) for seq in lost if seq.status is Status.FINISHED]
        return lost

    def abort(self, request_id: int, index: int | None = None) -> RequestOutput | None:
        """End an unfinished request now, every choice of it or choice `index` (finish reason "abort"), freeing their
        blocks and swap slots. Returns the output so far of the first choice ended, or None when none was unfinished
        (or the request never existed)."""
        outputs = []
        for seq in self.choices.members(request_id):
            if index is not None and seq.index != index:
                continue
            self.scheduler.abort(seq)
            seq.finish_reason = "abort"
            outputs.append(self._end(seq))
        return outputs[0] if outputs else None

    def generate(self, prompts: Iterable[str | list[int]], sampling: SamplingParams | None = None,
                 progress: Callable[[RequestOutput], None] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order, each prompt's choices in index order."""
        ids = [self.add_request(prompt, sampling) for prompt in prompts]
        done: dict[tuple[int, int], RequestOutput] = {}
        while self.has_unfinished():
            for output in self.step():
                done[output.request_id, output.index] = output
                if progress is not None:
                    progress(output)
        order = {request_id: position for position, request_id in enumerate(ids)}
        return [done[key] for key in sorted(done, key=lambda key: (order[key[0]], key[1]))]

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

    def _failed(self, seq: Sequence) -> TokenEvent:
        """A sequence that could not start or go on (its KV could not be opened or read): it ends now, its error in
        `warnings`."""
        seq.finish_reason = "error"
        output = self._end(seq)
        return TokenEvent(seq.group, None, output, index=seq.index, done=not self.choices.members(seq.group))

    def _tiered(self, max_tokens: int) -> bool:
        """Whether a sequence of up to `max_tokens` tokens is tiered (as Scheduler.add decides)."""
        return blocks_for(max_tokens, self.block_manager.block_tokens) > self.block_manager.num_blocks

    def _computed(self, chunks: list[ScheduledChunk]) -> None:
        """The forward ran `chunks`: their tokens' KV is in; a tiered prompt now complete is tiered."""
        for chunk in chunks:
            prompt_done = chunk.seq.kv is not None and chunk.completes and not chunk.seq.output_ids
            chunk.seq.num_computed += chunk.num_tokens
            if prompt_done:
                chunk.seq.kv.prompt_done()  # tiers the prompt before its first decode step

    def _score_prompts(self, logits: StepLogits) -> None:
        """Each prompt row's log-probability of the prompt's next token, for the sequences that asked."""
        for seq, position, rows in logits.prompt:
            targets = seq.prompt_ids[position + 1:position + 1 + len(rows)]
            seq.prompt_logprobs += token_logprobs(raw_logprobs(rows), targets,
                                                  [seq.sampling.prompt_logprobs] * len(targets))

    def _with_forks(self, completing: list[Sequence]) -> tuple[list[int], list[Sequence]]:
        """The step's sampled sequences with the choices forked now, and each one's logits row (a child samples its
        parent's)."""
        rows, seqs = list(range(len(completing))), list(completing)
        for row, seq in enumerate(completing):
            if seq.forks:
                for child in self.choices.fork(seq):
                    self._sequences[child.request_id] = child
                    rows.append(row)
                    seqs.append(child)
        return rows, seqs

    def _append(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> TokenEvent:
        """`token` is `seq`'s next: append it, end the sequence if it finished it, and report it."""
        seq.output_ids.append(token)
        if logprobs is not None:
            seq.cumulative_logprob += logprobs.logprob
        first = len(seq.output_ids) == 1
        reason = self._finish_reason(seq)
        output = None
        if reason:
            seq.finish_reason = reason
            self.scheduler.finish(seq)
            output = self._end(seq)
        return TokenEvent(seq.group, token, output, seq.started_s - seq.arrived_s if first else None, seq.index,
                          logprobs, seq.prompt_logprobs if first and seq.sampling.prompt_logprobs is not None else None,
                          output is not None and not self.choices.members(seq.group))

    def _end(self, seq: Sequence) -> RequestOutput:
        self.sampler.forget(seq.request_id)
        self.choices.end(seq)
        del self._sequences[seq.request_id]
        return self._output(seq)

    def _finish_reason(self, seq: Sequence) -> str | None:
        token, sampling = seq.output_ids[-1], seq.sampling
        if (not sampling.ignore_eos and token in self.eos_token_ids) or token in sampling.stop_token_ids:
            return "stop"
        grammar_end = self.sampler.grammar_end(seq) if sampling.grammar is not None else None
        if grammar_end == "error":
            seq.warnings.append("its grammar allows no token here: the output cannot continue")
        if grammar_end:
            return grammar_end
        if len(seq.output_ids) >= sampling.max_new_tokens:
            return "length"
        return None

    def _output(self, seq: Sequence) -> RequestOutput:
        text = self._decode(seq.output_ids) if self._decode is not None else None
        queue_s = None if seq.started_s is None else seq.started_s - seq.arrived_s
        return RequestOutput(seq.group, len(seq.prompt_ids), list(seq.output_ids), seq.finish_reason or "",
                             text, seq.swap_outs, seq.recomputes, list(seq.warnings), seq.tiered, queue_s, seq.index,
                             seq.cumulative_logprob if seq.sampling.wants_logprob else None)

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
