"""The scheduler's plan with tiered sequences beside paged ones (mechanics, no model: a fake tier provider)."""

from __future__ import annotations

from contextlib import nullcontext

from kvtier.engine.block_manager import BlockManager
from kvtier.engine.scheduler import Scheduler
from kvtier.engine.sequence import SamplingParams, Sequence
from kvtier.engine.tiered import TierBudgets, Tiers

BLOCK_TOKENS = 16


class FakeKV:
    def locate(self, row: int) -> None:
        pass

    def close(self) -> None:
        pass


class FakeProvider:
    def open(self, prompt_ids, max_tokens, device_budget, host_budget):
        return FakeKV(), 0

    def forwarding(self, decoding: int):
        return nullcontext()


def scheduler() -> Scheduler:
    tiers = Tiers(FakeProvider(), TierBudgets(device_blocks=2, device_bytes=2, host_bytes=1), max_seqs=2)
    return Scheduler(BlockManager(64, BLOCK_TOKENS), None, max_num_seqs=8, max_batched_tokens=256, tiers=tiers)


def add(sched: Scheduler, request_id: int, prompt_tokens: int, tiered: bool) -> Sequence:
    seq = Sequence(request_id, list(range(prompt_tokens)), SamplingParams(max_new_tokens=8), tiered=tiered)
    sched.waiting.append(seq)
    return seq


def step(sched: Scheduler) -> set[int]:
    """Schedule one step, 'run' it (every chunk computed, a token appended where the prompt is in) and return the
    ids of the sequences that ran."""
    chunks = sched.schedule()
    for chunk in chunks:
        chunk.seq.num_computed += chunk.num_tokens
        if chunk.seq.num_computed >= len(chunk.seq.prompt_ids):
            chunk.seq.output_ids.append(1)
    return {chunk.seq.request_id for chunk in chunks}


def decoding_tiered(sched: Scheduler) -> set[int]:
    """Two tiered sequences, stepped until both decode."""
    tiered = {add(sched, number, 40, tiered=True).request_id for number in (1, 2)}
    for _ in range(8):
        if step(sched) == tiered and all(seq.prompt_computed for seq in sched.running):
            return tiered
    raise AssertionError("the tiered prompts never finished")


def test_tiered_sequences_sit_out_one_step_in_two_while_a_paged_prompt_goes_in():
    sched = scheduler()
    tiered = decoding_tiered(sched)
    add(sched, 3, 600, tiered=False)  # three steps of 256 tokens
    ran = [step(sched) for _ in range(4)]
    assert ran == [{3}, tiered | {3}, {3}, tiered | {3}]  # its first forward runs without the tiered decodes
    assert sched.stats.tiered_sit_outs == 2
    assert step(sched) == tiered | {3}  # the prompt is in: everyone decodes together


def test_without_a_paged_prompt_the_tiered_sequences_run_every_step():
    sched = scheduler()
    tiered = decoding_tiered(sched)
    assert [step(sched) for _ in range(3)] == [tiered] * 3
    assert sched.stats.tiered_sit_outs == 0
