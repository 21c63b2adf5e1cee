"""Device block pool bookkeeping: which pool blocks are free, and each sequence's block table.

Pure Python and device-agnostic (nano-vllm style): it never touches tensors. A
block holds `block_tokens` consecutive tokens of one sequence; token i of a
sequence lives in block `block_table[i // block_tokens]` at offset
`i % block_tokens`.
"""

from __future__ import annotations

from collections import deque

from kvtier.errors import ConfigError
from kvtier.engine.sequence import Sequence


def blocks_for(num_tokens: int, block_tokens: int) -> int:
    """Blocks needed to hold `num_tokens` tokens."""
    return -(-num_tokens // block_tokens)


class BlockManager:
    """A free list of `num_blocks` device blocks handed out to sequences."""

    def __init__(self, num_blocks: int, block_tokens: int) -> None:
        if num_blocks < 1 or block_tokens < 1:
            raise ConfigError(f"block pool needs at least one block of at least one token, "
                              f"got {num_blocks} blocks of {block_tokens} tokens")
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """More blocks `seq` needs so that its table covers `num_tokens` tokens."""
        return max(0, blocks_for(num_tokens, self.block_tokens) - len(seq.block_table))

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend `seq`'s block table to cover `num_tokens` tokens; the caller checked there is room."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed > len(self._free):
            raise RuntimeError(f"block pool: {needed} blocks needed, {len(self._free)} free (scheduler bug)")
        seq.block_table.extend(self._free.popleft() for _ in range(needed))

    def allocate(self, count: int) -> list[int]:
        """`count` free blocks (for a swap-in); the caller checked there is room."""
        if count > len(self._free):
            raise RuntimeError(f"block pool: {count} blocks needed, {len(self._free)} free (scheduler bug)")
        return [self._free.popleft() for _ in range(count)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)

    def release(self, seq: Sequence) -> None:
        """Give all of `seq`'s blocks back and empty its table."""
        self.free(seq.block_table)
        seq.block_table = []
