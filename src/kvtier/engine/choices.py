"""The sequences of each request: one per choice (SamplingParams.n, best_of), forked as vLLM forks them.

A request for k > 1 sequences runs as one sequence until its prompt is computed. Then, in the step
that samples its first token, k - 1 children fork from it: each copies its block table and holds
every block of it (block_manager.py counts holders), so the prompt's KV sits in the pool once. The
first token a child writes into a shared block (the prompt's last, partly filled one) makes it copy
that block (copy-on-write); after that every choice writes only blocks of its own. A preempted
choice is swapped out or recomputed alone; swapped back in, its blocks are its own.

A tiered request's KV is a cache of its own that cannot be shared, so its choices run as k
independent sequences from the start (each prefills the prompt). Forked children run at once, so
the running sequences may exceed `max_num_seqs` by k - 1 until they finish.
"""

from __future__ import annotations

from kvtier.engine.block_manager import BlockManager
from kvtier.engine.scheduler import Scheduler
from kvtier.engine.sequence import Sequence


class Choices:
    """Request id -> its live sequences; new sequence ids; forks."""

    def __init__(self, scheduler: Scheduler, blocks: BlockManager) -> None:
        self._scheduler, self._blocks = scheduler, blocks
        self._live: dict[int, list[Sequence]] = {}
        self._next_id = 0

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def add(self, seq: Sequence) -> list[Sequence]:
        """Queue `seq` (choice 0 of a new request, its id the request's) and whatever choices start with it; return
        the sequences queued."""
        self._scheduler.add(seq)
        queued = [seq]
        extra = seq.sampling.sequences - 1
        if extra and seq.tiered:
            for index in range(1, extra + 1):
                sibling = Sequence(self.new_id(), seq.prompt_ids, seq.sampling.for_choice(index),
                                   arrived_s=seq.arrived_s, group=seq.group, index=index)
                self._scheduler.add(sibling)
                queued.append(sibling)
        elif extra:
            seq.forks = extra
        self._live[seq.group] = list(queued)
        return queued

    def fork(self, seq: Sequence) -> list[Sequence]:
        """`seq`'s prompt is computed: its pending choices, running now and holding its blocks."""
        children = []
        for index in range(seq.index + 1, seq.index + seq.forks + 1):
            child = Sequence(self.new_id(), seq.prompt_ids, seq.sampling.for_choice(index),
                             block_table=list(seq.block_table), num_computed=seq.num_computed,
                             arrived_s=seq.arrived_s, started_s=seq.started_s, group=seq.group, index=index,
                             prompt_logprobs=seq.prompt_logprobs)
            self._blocks.share(child.block_table)
            # Scheduler offers no public way in for a sequence that is already running; this is its own path for one.
            self._scheduler._start_running(child)
            children.append(child)
        seq.forks = 0
        self._live[seq.group] += children
        return children

    def members(self, group: int) -> list[Sequence]:
        """The unfinished sequences of request `group`."""
        return list(self._live.get(group, ()))

    def end(self, seq: Sequence) -> bool:
        """`seq` finished; True when its request has no unfinished sequence left."""
        members = [member for member in self._live.get(seq.group, []) if member is not seq]
        self._live[seq.group] = members
        if members:  # a sequence ending before it forked (aborted, failed) takes its pending choices with it
            return False
        self._live.pop(seq.group, None)
        return True
