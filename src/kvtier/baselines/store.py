"""The baselines' disk tier: TieredStore's whole-block appends plus reads of chosen blocks only.

Full offload reads every stored block of a layer; a selective baseline reads
the blocks its design needs (all K blocks for H2O, the blocks of the chosen
tokens or chunks for InfiniGen and LeoAM). Block b of sequence s is always read
into the slot a whole-layer read would give it, so a stored token keeps one
address in the staging buffer: `tokens(kind)` views the buffer token-major and
pool index i of sequence s is row [s, i]. Only rows of blocks read since the
last overwrite are meaningful; callers gather exactly those.

A store may own several such buffers: InfiniGen fetches layer l+1 while layer
l still gathers from its own buffer, so its layers alternate between two.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import Future, wait

import numpy as np
import torch

from kvtier.kv.offload import TieredStore
from kvtier.storage import KVBlockFile, aligned_buffer

BlockId = tuple[int, int, int]  # (K or V, sequence, block)


class SelectiveStore(TieredStore):
    """One block file of whole blocks per (layer, sequence); chosen blocks are read into fixed staging slots."""

    def __init__(self, file: KVBlockFile, tier_of_layer: dict[int, int], batch_size: int, buffers: int = 1) -> None:
        super().__init__(file, tier_of_layer, batch_size)
        self._buffers = [self._staging] + [aligned_buffer(self._staging.nbytes) for _ in range(buffers - 1)]
        self._in_flight: list[Future] = []

    def stored_tokens(self, layer: int) -> int:
        """Tokens per sequence of `layer` on disk (whole blocks)."""
        return self.stored_blocks[layer] * self.layout.block_tokens

    def all_blocks(self, layer: int, kinds: Iterable[int]) -> list[BlockId]:
        """Every stored block of `layer` of the given kinds, for all sequences."""
        return [(kind, seq, block) for kind in kinds for seq in range(self.batch_size)
                for block in range(self.stored_blocks[layer])]

    def read(self, layer: int, blocks: Sequence[BlockId], buffer: int = 0) -> None:
        """Read `blocks` of `layer` into their slots of `buffer` now."""
        self.file.read_blocks(self._plan(layer, blocks, buffer))

    def submit(self, layer: int, blocks: Sequence[BlockId], buffer: int = 0) -> Future:
        """`read` in the background (I/O threads); `.result()` waits and raises read or checksum errors."""
        future = self.file.submit_read_blocks(self._plan(layer, blocks, buffer))
        self._in_flight = [pending for pending in self._in_flight if not pending.done()] + [future]
        return future

    def tokens(self, kind: int, buffer: int = 0) -> torch.Tensor:
        """[batch, capacity tokens, heads, head_dim] view of `kind` in `buffer`, token-major as stored."""
        per_kind = self.batch_size * self.blocks_per_seq * self.layout.block_bytes
        raw = self._buffers[buffer][kind * per_kind : (kind + 1) * per_kind]
        flat = torch.from_numpy(raw).view(self._torch_dtype)
        return flat.view(self.batch_size, self.blocks_per_seq * self._block_shape[0], *self._block_shape[1:])

    def _plan(self, layer: int, blocks: Sequence[BlockId], buffer: int) -> list[tuple[int, int, int, np.ndarray]]:
        size, tier = self.layout.block_bytes, self.tier_of_layer[layer]
        plan = []
        for kind, seq, block in blocks:
            start = ((kind * self.batch_size + seq) * self.blocks_per_seq + block) * size
            plan.append((tier, kind, seq * self.blocks_per_seq + block, self._buffers[buffer][start : start + size]))
        return plan

    def close(self) -> None:
        """Let reads in flight finish (nobody may still want them), then delete the file."""
        wait(self._in_flight)
        self._in_flight = []
        super().close()
