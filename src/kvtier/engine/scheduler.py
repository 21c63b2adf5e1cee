"""Continuous batching with preemption: which tokens run in the next forward, and whose KV leaves the device.

Each `schedule()` call, in this order (every decision depends only on the
requests and the pool, never on I/O timing, so the flash and DRAM backends
produce the same schedule, the same swaps and therefore the same outputs):

1. Finish last step's swap-outs: wait for each write (normally long done, as it
   overlapped the previous forward) and only then free its device blocks.
2. Swap in swapped sequences, oldest first, while the pool has room for them
   plus one block per running sequence, so a sequence brought back never takes
   the blocks a stalled sequence preempted someone to get (that ping-pong,
   swapping the same victims out and in every step, is what a smaller margin
   produced). Synchronous: the KV is back before the sequence's next step. A
   failed or corrupted read (ChecksumError) turns into a recompute, recorded in
   the sequence's warnings.
3. Admit waiting sequences (new or to recompute) when the pool holds their
   prompt plus vLLM's watermark (1% of the pool), and only when no swapped
   sequence is waiting (swapped ones go first, as in vLLM). Running sequences
   then grow into the rest and preemption handles it when they outgrow it; the
   earlier rule (one spare block per running sequence) admitted so cautiously
   that the benchmark workloads ran almost one at a time and never swapped.
   A tiered sequence (tiered.py) is admitted in its turn when fewer than
   `max_tiered_seqs` run and the pool has room for its window's reservation;
   its KV is opened then (a stored document's prefix loaded into it).
4. Plan the forward: running sequences by priority then arrival get their next
   tokens (one for a decode, a chunk for a prefill, within a token budget) if
   their blocks can grow. When the pool is out, a victim is preempted: lowest
   priority first, among equals the least recently run (a sequence stalled for
   blocks goes first), then the latest arrival; with no one left to evict, the
   sequence preempts itself (vLLM's rule). A swap-out is submitted and the
   batch keeps stepping; the sequence that needed room waits one step. A
   full swap space (FlashFullError) or no swap backend means recompute: the
   victim's blocks are freed at once and it re-enters the waiting queue.
   A tiered sequence is scheduled like the rest (a prefill chunk within the
   token budget, or one decode token) but needs no new blocks, and is never a
   victim for blocks: its reservation is small and its tiers lie outside the pool.
   While a paged sequence's prompt is not in yet, the tiered sequences sit out
   one step in two: a forward with tiered decodes costs a sparse step per
   tiered sequence (hundreds of ms on a CPU), and a short request's first
   token should not wait through it.

A tiered sequence gives up its share (admission, step 3) to a waiting tiered
request of higher priority, or, with `Tiers.slice_tokens`, of equal priority
once it has decoded that many tokens since it last started: its KV is set
aside (its device window and hot pool written to flash, its cold pool left
where it is), its reservation freed, and it queues again at the back of the
waiting queue, to be brought back exactly where it stopped when its turn
comes. Only a sequence past its prompt is set aside. A failed write leaves it
running as it was (no room is made); a failed read back recomputes it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass

from kvtier.errors import ChecksumError, ConfigError, KvtierError, StorageError
from kvtier.engine.block_manager import BlockManager, blocks_for
from kvtier.engine.model_runner import ScheduledChunk
from kvtier.engine.sequence import Sequence, Status
from kvtier.engine.swap.backend import PendingSwapOut, SwapBackend
from kvtier.engine.tiered import Tiers
from kvtier.storage.flash_log import FlashFullError


@dataclass
class SchedulerStats:
    steps: int = 0
    preemptions: int = 0
    swap_outs: int = 0
    swap_ins: int = 0
    recomputes: int = 0
    swap_full_fallbacks: int = 0
    swap_failures: int = 0
    checksum_failures: int = 0
    stalls: int = 0  # sequence-steps skipped while waiting for blocks
    tiered_set_asides: int = 0  # tiered sequences preempted: window and hot pool written to flash
    tiered_set_aside_bytes: int = 0
    tiered_sit_outs: int = 0  # steps the tiered sequences sat out for a paged prompt

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class Scheduler:
    """Queues of sequences and the policy that moves them between device, swap space and recompute."""

    def __init__(self, blocks: BlockManager, swap: SwapBackend | None, max_num_seqs: int = 32,
                 max_batched_tokens: int = 512, tiers: Tiers | None = None) -> None:
        if max_num_seqs < 1 or max_batched_tokens < 1:
            raise ConfigError(f"max_num_seqs and max_batched_tokens must be positive, "
                              f"got {max_num_seqs} and {max_batched_tokens}")
        self.blocks = blocks
        self.swap = swap
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.swapping_out: list[tuple[Sequence, PendingSwapOut]] = []
        self.stats = SchedulerStats()
        self.tiers = tiers
        self.failed: list[Sequence] = []  # sequences that could not start (their error in `warnings`), this step
        self._last_run: dict[int, int] = {}
        self._started_at: dict[int, int] = {}  # a running tiered sequence's output length when it last started
        self._sat_out = False  # the tiered sequences sat out the last step

    def add(self, seq: Sequence) -> None:
        """Queue `seq`: paged when the pool could hold all of its KV, else tiered (when the engine has tiers)."""
        needed = blocks_for(seq.max_tokens, self.blocks.block_tokens)
        if needed > self.blocks.num_blocks:
            if self.tiers is None:
                raise ConfigError(
                    f"request {seq.request_id} may need {seq.max_tokens} tokens = {needed} KV blocks, but the device "
                    f"pool has {self.blocks.num_blocks}; raise the device KV budget or lower max_new_tokens")
            seq.tiered = True
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.swapping_out)

    def schedule(self) -> list[ScheduledChunk]:
        """Move sequences between queues and return the chunks of the next forward (maybe empty)."""
        self.stats.steps += 1
        self.failed = []
        self._finish_swap_outs()
        self._swap_in()
        if not self.swapped:
            self._admit()
        return self._plan()

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = Status.FINISHED

    def abort(self, seq: Sequence) -> None:
        """Take `seq` out of whichever queue holds it and free its device blocks and swap slots."""
        if seq.status is Status.SWAPPING_OUT:  # its write reads the blocks: let it land, then drop both
            pending = next(p for s, p in self.swapping_out if s is seq)
            self.swapping_out = [(s, p) for s, p in self.swapping_out if s is not seq]
            pending.future.exception()
            self.swap.discard(pending.slots)
        elif seq.status is Status.SWAPPED:
            self.swapped.remove(seq)
            self.swap.discard(seq.swap_slots)
            seq.swap_slots = []
        elif seq.status is Status.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = Status.FINISHED

    def drop_lost(self, chunks: list[ScheduledChunk]) -> list[Sequence]:
        """After a forward: the tiered sequences among `chunks` whose KV failed a read in it (SequenceKV.failure),
        taken out of the batch: recomputed from the prompt, or, when their stored document must not be recomputed
        over (`on_corrupt` fail), ended with the error (status FINISHED). Their rows of the forward are dropped."""
        lost = []
        for seq in (chunk.seq for chunk in chunks):
            error = seq.kv.failure() if seq.kv is not None else None
            if error is None:
                continue
            lost.append(seq)
            self.running.remove(seq)
            self.stats.checksum_failures += isinstance(error, ChecksumError)
            try:
                seq.kv.forget_damaged()
            except KvtierError as failed:
                self._release(seq)
                seq.warnings.append(str(failed))
                seq.status = Status.FINISHED
                continue
            self._release(seq)
            self._recompute(seq, f"tiered KV unreadable, recomputed: {error}")
        return lost

    def tiered_running(self) -> list[Sequence]:
        return [seq for seq in self.running if seq.kv is not None]

    def _release(self, seq: Sequence) -> None:
        """Give back what `seq` holds: its device blocks and, if tiered, every tier of its KV."""
        self.blocks.release(seq)
        self._last_run.pop(seq.request_id, None)
        self._started_at.pop(seq.request_id, None)
        if seq.kv is not None:
            seq.kv.close()
            seq.kv = None

    def close(self) -> None:
        """Wait for swap-outs in flight (their writes read pool memory)."""
        for _, pending in self.swapping_out:
            pending.future.exception()
        self.swapping_out.clear()

    # ----- the four phases -----

    def _finish_swap_outs(self) -> None:
        for seq, pending in self.swapping_out:
            try:
                pending.wait()
            except StorageError as error:  # the copy failed: the slots are garbage, recompute the sequence
                self.swap.discard(pending.slots)
                self.stats.swap_failures += 1
                self._recompute(seq, f"swap-out failed, recomputed: {error}")
                continue
            self.blocks.release(seq)
            seq.swap_slots = pending.slots
            seq.status = Status.SWAPPED
            self.swapped.append(seq)
        self.swapping_out.clear()

    def _swap_in(self) -> None:
        while self.swapped and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            if self.blocks.num_free < len(seq.swap_slots) + len(self.running):
                return
            self.swapped.popleft()
            device_blocks = self.blocks.allocate(len(seq.swap_slots))
            try:
                self.swap.swap_in(seq.swap_slots, device_blocks)
            except StorageError as error:
                self.blocks.free(device_blocks)
                if isinstance(error, ChecksumError):
                    self.stats.checksum_failures += 1
                else:
                    self.stats.swap_failures += 1
                seq.swap_slots = []
                self._recompute(seq, f"swap-in failed, recomputed: {error}")
                continue
            seq.block_table, seq.swap_slots = device_blocks, []
            self.stats.swap_ins += 1
            self._start_running(seq)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.tiered:
                if not self._admit_tiered(seq):
                    return
                continue
            if self.blocks.num_free < blocks_for(seq.num_tokens, self.blocks.block_tokens) + self._watermark():
                return
            self.waiting.popleft()
            self.blocks.grow(seq, seq.num_tokens)
            self._start_running(seq)

    def _admit_tiered(self, seq: Sequence) -> bool:
        """Start the tiered sequence at the head of the queue if a tiered share is free; False when it must wait.
        Its KV is opened now (a stored document's prefix loaded into it); a failure ends the request."""
        tiers = self.tiers
        if len(self.tiered_running()) >= tiers.max_seqs and not self._make_tiered_room(seq):
            return False
        if self.blocks.num_free < tiers.budgets.device_blocks + self._watermark():
            return False
        self.waiting.popleft()
        if seq.kv is not None:  # set aside earlier: bring it back where it stopped
            return self._bring_back(seq)
        try:
            seq.kv, seq.num_computed = tiers.provider.open(seq.prompt_ids, seq.max_tokens, tiers.budgets.device_bytes,
                                                           tiers.budgets.host_bytes)
        except KvtierError as error:
            seq.warnings.append(str(error))
            seq.status = Status.FINISHED
            self.failed.append(seq)
            return True
        seq.block_table = self.blocks.allocate(tiers.budgets.device_blocks)
        self._start_running(seq)
        return True

    def _make_tiered_room(self, seq: Sequence) -> bool:
        """Set aside the running tiered sequence that `seq` may take a share from (see the module docstring)."""
        victim = min(self._tiered_victims(seq), key=self._tiered_victim_key, default=None)
        if victim is None:
            return False
        try:
            written = victim.kv.set_aside()
        except StorageError as error:  # nothing was lost: it runs on, and `seq` waits
            victim.warnings.append(f"could not be set aside for another request: {error}")
            return False
        self.running.remove(victim)
        self.blocks.release(victim)  # its device window's reservation
        victim.status = Status.WAITING
        self.waiting.append(victim)
        self.stats.tiered_set_asides += 1
        self.stats.tiered_set_aside_bytes += written
        return True

    def _tiered_victims(self, seq: Sequence) -> list[Sequence]:
        """Running tiered sequences past their prompt that `seq` outranks, or (with a slice) has waited for."""
        slice_tokens, priority = self.tiers.slice_tokens, seq.sampling.priority
        return [victim for victim in self.tiered_running() if victim.output_ids and (
            victim.sampling.priority < priority or (
                slice_tokens and victim.sampling.priority == priority and
                len(victim.output_ids) - self._started_at.get(victim.request_id, 0) >= slice_tokens))]

    def _tiered_victim_key(self, seq: Sequence) -> tuple[int, int]:
        """Lowest priority first, then the longest run since it started."""
        return seq.sampling.priority, self._started_at.get(seq.request_id, 0) - len(seq.output_ids)

    def _bring_back(self, seq: Sequence) -> bool:
        """Resume a set-aside tiered sequence; unreadable KV (a checksum or read error) recomputes it."""
        try:
            seq.kv.bring_back()
        except StorageError as error:
            self.stats.checksum_failures += isinstance(error, ChecksumError)
            self._release(seq)  # closes its KV, as for any sequence whose KV is given up
            self._recompute(seq, f"set-aside KV unreadable, recomputed: {error}")
            return True
        seq.block_table = self.blocks.allocate(self.tiers.budgets.device_blocks)
        self._start_running(seq)
        return True

    def _plan(self) -> list[ScheduledChunk]:
        chunks: list[ScheduledChunk] = []
        budget = self.max_batched_tokens
        # Decodes first (one token each), then prefill chunks, each group by priority then arrival.
        order = sorted(self.running, key=lambda s: (s.pending_tokens() > 1, -s.sampling.priority, s.request_id))
        sitting_out = self._tiered_sit_out()
        for seq in order:
            if seq not in self.running:  # preempted as a victim earlier in this loop
                continue
            count = min(seq.pending_tokens(), budget)
            if count == 0:
                break
            if seq.kv is not None:  # its device blocks were reserved at admission
                if sitting_out:
                    continue
                chunks.append(ScheduledChunk(seq, count))
                self._last_run[seq.request_id] = self.stats.steps
                budget -= count
                continue
            needed = self.blocks.blocks_needed(seq, seq.num_computed + count)
            if needed > self.blocks.num_free:
                scheduled = {chunk.seq.request_id for chunk in chunks}
                if not self._make_room(needed, exclude=scheduled | {seq.request_id}):
                    self._preempt(seq)  # nobody left to evict: it yields its own blocks, as in vLLM
                    continue
            if needed > self.blocks.num_free:
                self.stats.stalls += 1  # room is coming from a swap-out in flight: wait one step
                continue
            self.blocks.grow(seq, seq.num_computed + count)
            chunks.append(ScheduledChunk(seq, count))
            self._last_run[seq.request_id] = self.stats.steps
            budget -= count
        return chunks

    def _tiered_sit_out(self) -> bool:
        """Whether the tiered sequences sit out this step: a paged prompt is not in yet, tiered sequences run,
        and they did not sit out the last step."""
        paged_prompt = any(seq.kv is None and not seq.prompt_computed for seq in self.running)
        tiered = any(seq.kv is not None for seq in self.running)
        self._sat_out = paged_prompt and tiered and not self._sat_out
        self.stats.tiered_sit_outs += self._sat_out
        return self._sat_out

    # ----- preemption -----

    def _make_room(self, needed: int, exclude: set[int]) -> bool:
        """Preempt victims until `needed` blocks are free now or freed by swap-outs in flight; False if impossible."""
        coming = sum(len(seq.block_table) for seq, _ in self.swapping_out)
        # A tiered sequence holds only its window's reservation: preempting it would free little.
        candidates = sorted((s for s in self.running if s.request_id not in exclude and s.kv is None),
                            key=self._victim_key)
        for victim in candidates:
            if self.blocks.num_free + coming >= needed:
                return True
            coming += self._preempt(victim)
        return self.blocks.num_free + coming >= needed

    def _victim_key(self, seq: Sequence) -> tuple[int, int, int]:
        return seq.sampling.priority, self._last_run.get(seq.request_id, -1), -seq.request_id

    def _preempt(self, victim: Sequence) -> int:
        """Swap out or drop `victim`; return the blocks that will come free when its swap-out completes."""
        self.running.remove(victim)
        self.stats.preemptions += 1
        if self.swap is not None:
            try:
                pending = self.swap.swap_out(victim.block_table)
            except FlashFullError:
                self.stats.swap_full_fallbacks += 1
            else:
                victim.status = Status.SWAPPING_OUT
                victim.swap_outs += 1
                self.stats.swap_outs += 1
                self.swapping_out.append((victim, pending))
                return len(victim.block_table)
        self._recompute(victim, None)
        return 0

    def _recompute(self, seq: Sequence, warning: str | None) -> None:
        self.blocks.release(seq)
        seq.reset_for_recompute()
        if warning:
            seq.warnings.append(warning)
        self.stats.recomputes += 1
        self.waiting.appendleft(seq)

    def _start_running(self, seq: Sequence) -> None:
        seq.status = Status.RUNNING
        self._last_run[seq.request_id] = self.stats.steps
        self._started_at[seq.request_id] = len(seq.output_ids)
        self.running.append(seq)

    def _watermark(self) -> int:
        """Blocks kept free when admitting a sequence: vLLM's watermark, 1% of the pool rounded down."""
        return self.blocks.num_blocks // 100
