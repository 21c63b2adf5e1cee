"""Runs one engine step through the real model: packs the scheduled tokens, stores their KV, returns logits.

The scheduler decides *which* tokens run; this module turns that into one
forward: input ids and positions packed as [1, N], each token's pool slot
(block, offset) from its sequence's block table, and logits only for the
sequences whose pending tokens all ran this step (they sample their next token), plus,
for a sequence that asked for its prompt's log-probabilities, the rows of its prompt tokens
not scored yet (each row's logits score the prompt's next token).
A tiered sequence's tokens get no pool slot: its own KV stores them (tiered.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.engine.kv_pool import KVPool
from kvtier.engine.paged_attention import PagedBatch, Segment, register
from kvtier.engine.sequence import Sequence


@dataclass(frozen=True)
class StepLogits:
    """A forward's kept logits: `sample` [n, vocab], one row per completing chunk in order; `prompt`, per chunk
    whose sequence wants prompt log-probabilities, (its sequence, the first prompt position scored, [rows, vocab])."""

    sample: torch.Tensor
    prompt: list[tuple[Sequence, int, torch.Tensor]]


@dataclass(frozen=True)
class ScheduledChunk:
    """`num_tokens` tokens of `seq`, starting at its first uncomputed token."""

    seq: Sequence
    num_tokens: int

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the last token, so the step yields the next token."""
        return self.seq.num_computed + self.num_tokens == self.seq.num_tokens


class ModelRunner:
    """Owns the model's attention implementation while the engine lives; restores it on close."""

    def __init__(self, model: torch.nn.Module, pool: KVPool) -> None:
        self.model = model
        self.pool = pool
        self.device = pool.device
        self._previous_attention = model.config._attn_implementation
        model.set_attn_implementation(register())

    def close(self) -> None:
        self.model.set_attn_implementation(self._previous_attention)

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> StepLogits:
        """Forward the chunks; return the last-position logits of the completing chunks, and the prompt rows asked."""
        ids, positions, blocks, offsets, segments, sample_rows, paged_rows = [], [], [], [], [], [], []
        prompt_spans: list[tuple[Sequence, int, int, int]] = []  # (seq, first position, first row, rows)
        start = 0
        block_tokens = self.pool.block_tokens
        for chunk in chunks:
            seq, first = chunk.seq, chunk.seq.num_computed
            span = range(first, first + chunk.num_tokens)
            ids.extend(seq.token_ids[first:first + chunk.num_tokens])
            positions.extend(span)
            if seq.kv is not None:  # a tiered sequence: its KV stores and attends its tokens
                seq.kv.locate(start + chunk.num_tokens - 1)
                segments.append(Segment(start, chunk.num_tokens, first, None, seq.kv))
            else:
                paged_rows.extend(range(start, start + chunk.num_tokens))
                blocks.extend(seq.block_table[p // block_tokens] for p in span)
                offsets.extend(p % block_tokens for p in span)
                covered = -(-span.stop // block_tokens)
                table = torch.tensor(seq.block_table[:covered], dtype=torch.long, device=self.device)
                segments.append(Segment(start, chunk.num_tokens, first, table))
            scored = _unscored_prompt(seq, span)
            if scored:
                prompt_spans.append((seq, scored.start, start + scored.start - first, len(scored)))
            start += chunk.num_tokens
            if chunk.completes:
                sample_rows.append(start - 1)
        rows = None if len(paged_rows) == start else self._long(paged_rows)
        batch = PagedBatch(self.pool, self._long(blocks), self._long(offsets), tuple(segments), rows)
        extra = [row for _, _, first_row, count in prompt_spans for row in range(first_row, first_row + count)]
        logits = self.model(input_ids=self._long(ids)[None], position_ids=self._long(positions)[None],
                            use_cache=False, paged_batch=batch,
                            logits_to_keep=self._long(sample_rows + extra)).logits[0]
        prompt, kept = [], len(sample_rows)
        for seq, position, _, count in prompt_spans:
            prompt.append((seq, position, logits[kept:kept + count]))
            kept += count
        return StepLogits(logits[:len(sample_rows)], prompt)

    def _long(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)


def _unscored_prompt(seq: Sequence, span: range) -> range:
    """Positions of `span` whose logits score a prompt token `seq` wants a log-probability for and has none yet
    (position p scores token p + 1; a recomputed prompt is not scored twice)."""
    if seq.sampling.prompt_logprobs is None:
        return range(0)
    return range(max(span.start, len(seq.prompt_logprobs)), min(span.stop, len(seq.prompt_ids) - 1))
