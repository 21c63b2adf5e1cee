"""Device block pool bookkeeping: which pool blocks are free, each sequence's block table, and shared blocks.

Pure Python and device-agnostic (nano-vllm style): it never touches tensors. A
block holds `block_tokens` consecutive tokens of one sequence; token i of a
sequence lives in block `block_table[i // block_tokens]` at offset
`i % block_tokens`.

Blocks are reference-counted, as in vLLM: the choices of a request with n > 1 fork from one
sequence once its prompt is computed and share its blocks (`share`). A shared block is read-only:
before a sequence writes a token into one (`grow` over the positions it is about to compute), it
gets a block of its own, and the copy it needs is queued (`take_copies`) for the engine to make
before the forward. A block returns to the free list when its last holder lets go.
"""

from __future__ import annotations

from collections import deque

from kvtier.errors import ConfigError
from kvtier.engine.sequence import Sequence


def blocks_for(num_tokens: int, block_tokens: int) -> int:
    """Blocks needed to hold `num_tokens` tokens."""
    return -(-num_tokens // block_tokens)


class BlockManager:
    """A free list of `num_blocks` device blocks handed out to sequences, each with a reference count."""

    def __init__(self, num_blocks: int, block_tokens: int) -> None:
        if num_blocks < 1 or block_tokens < 1:
            raise ConfigError(f"block pool needs at least one block of at least one token, "
                              f"got {num_blocks} blocks of {block_tokens} tokens")
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._copies: list[tuple[int, int]] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """More blocks `seq` needs so that its table covers `num_tokens` tokens and it owns every block it writes."""
        grown = max(0, blocks_for(num_tokens, self.block_tokens) - len(seq.block_table))
        return grown + len(self._shared_writes(seq, num_tokens))

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Make `seq`'s table cover `num_tokens` tokens, copying the shared blocks it will write from `num_computed`
        on (copies queued for `take_copies`); the caller checked there is room."""
        self._check_room(self.blocks_needed(seq, num_tokens))
        for index in self._shared_writes(seq, num_tokens):
            source = seq.block_table[index]
            seq.block_table[index] = self._take()
            self._copies.append((source, seq.block_table[index]))
            self._drop(source)
        seq.block_table.extend(self._take() for _ in range(self.blocks_needed(seq, num_tokens)))

    def allocate(self, count: int) -> list[int]:
        """`count` free blocks (for a swap-in); the caller checked there is room."""
        self._check_room(count)
        return [self._take() for _ in range(count)]

    def share(self, blocks: list[int]) -> None:
        """One more holder of each of `blocks` (a forked sequence's copy of its parent's table)."""
        for block in blocks:
            self._refs[block] += 1

    def free(self, blocks: list[int]) -> None:
        """One holder fewer for each of `blocks`; those nobody holds any more are free again."""
        for block in blocks:
            self._drop(block)

    def release(self, seq: Sequence) -> None:
        """Give all of `seq`'s blocks back and empty its table."""
        self.free(seq.block_table)
        seq.block_table = []

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies queued by `grow` since the last call; the engine makes them
        before the next forward (a source stays unwritten until then: only its other holders keep it)."""
        copies, self._copies = self._copies, []
        return copies

    def _shared_writes(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Indexes in `seq`'s table of the shared blocks that positions num_computed..num_tokens-1 fall in."""
        first = seq.num_computed // self.block_tokens
        last = min(blocks_for(num_tokens, self.block_tokens), len(seq.block_table))
        return [index for index in range(first, last) if self._refs[seq.block_table[index]] > 1]

    def _check_room(self, count: int) -> None:
        if count > len(self._free):
            raise RuntimeError(f"block pool: {count} blocks needed, {len(self._free)} free (scheduler bug)")

    def _take(self) -> int:
        block = self._free.popleft()
        self._refs[block] = 1
        return block

    def _drop(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)
