"""Time one prefill and a fixed number of greedy decode steps through any KV cache.

Shared by the benchmarks: every mode is measured by the same loop, so a ratio
between two modes compares caches, not harnesses. Batch rows decode
independently (each row takes its own argmax); no early stop at end-of-sequence,
so every mode runs exactly `new_tokens` timed steps.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from kvtier.generation import prefill
from kvtier.sparse import decoding

if TYPE_CHECKING:
    from kvtier.eval.sparse.prefill_tape import PrefillTape


def measure_decode(model, cache, ids: torch.Tensor, new_tokens: int, prefill_chunk: int = 1024,
                   warmup_steps: int = 1, label: str | None = None, decode_mode: str | None = None,
                   tape: PrefillTape | None = None) -> dict:
    """Prefill `ids` [B, N], place the prompt in the cache's tiers (`place_prompt`), run
    `warmup_steps` untimed steps, then `new_tokens` timed steps. Returns timings, disk bytes per step and the
    generated token ids [B, warmup + new_tokens]. With a `label`, a progress bar of forward
    passes goes to stderr. The decode steps run on `decode_mode`'s threads and cores
    (kvtier.sparse.threads.decoding); prefill runs on the threads set when called. With a `tape` of `ids`
    (kvtier.eval.sparse.prefill_tape), the prompt is replayed from it instead of computed again, and
    `prefill_s` is the replay plus the last chunk's forward pass."""
    prefill_passes = tape.passes if tape is not None else -(-ids.shape[1] // prefill_chunk)
    bar = tqdm(total=prefill_passes + warmup_steps + new_tokens, desc=label, unit="pass", file=sys.stderr,
               leave=False, disable=label is None)
    with torch.inference_mode(), bar:
        started = time.perf_counter()
        if tape is None:
            logits = prefill(model, cache, ids, prefill_chunk, lambda tokens: bar.update())
        else:
            logits = tape.prefill(model, cache, bar.update)
        with decoding(decode_mode):
            cache.place_prompt()  # part of prefill, under the decode's threads (the sparse path calibrates APP)
            prefill_s = time.perf_counter() - started
            tokens = []
            for _ in range(warmup_steps):
                logits = _step(model, cache, logits, tokens)
                bar.update()
            before = cache.io_stats()
            step_s = []
            for _ in range(new_tokens):
                started = time.perf_counter()
                logits = _step(model, cache, logits, tokens)
                step_s.append(time.perf_counter() - started)
                bar.update()
            moved = cache.io_stats().minus(before)
    decode_s = sum(step_s)
    return {
        "prefill_s": prefill_s,
        "prefill_replayed": tape is not None,
        "decode_s": decode_s,
        "ms_per_token": decode_s * 1000 / max(new_tokens, 1),
        "median_step_ms": statistics.median(step_s) * 1000 if step_s else 0.0,
        "step_ms": [s * 1000 for s in step_s],
        "disk_read_bytes_per_step": moved.bytes_read / max(new_tokens, 1),
        "disk_written_bytes_per_step": moved.bytes_written / max(new_tokens, 1),
        "token_ids": torch.cat(tokens, dim=1).tolist() if tokens else [],
    }


def _step(model, cache, logits: torch.Tensor, tokens: list[torch.Tensor]) -> torch.Tensor:
    token = logits.argmax(-1, keepdim=True)
    tokens.append(token)
    return model(input_ids=token, cache=cache).logits[:, -1]
