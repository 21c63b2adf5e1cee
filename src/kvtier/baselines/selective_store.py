"""The baselines' disk tier: TieredStore's whole-block appends plus reads of what a baseline chose.

Full offload reads every stored block of a layer; a selective baseline reads
what its design needs: every K block for H2O (`read` / `submit` of whole
blocks), and the chosen tokens or chunks for H2O's values, InfiniGen and LeoAM
(`read_tokens` / `submit_tokens`). Chosen tokens cost the pages holding them
(the file's read unit: 512-byte sectors where O_DIRECT takes them), gaps of
one page bridged: the granularity at which the sparse path fetches its cold
tokens, so no baseline pays for whole 64-token blocks where kvtier pays for
sectors. (Where blocks do not fill whole pages, e.g. some tiny
test models, the blocks holding the tokens are read instead.)

Block b of sequence s is always read into the slot a whole-layer read would
give it, so a stored token keeps one address in the staging buffer:
`tokens(kind)` views the buffer token-major and pool index i of sequence s is
row [s, i]. Only rows read since the last overwrite are meaningful; callers
gather exactly those.

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
from kvtier.storage.pages import pages_holding

BlockId = tuple[int, int, int]  # (K or V, sequence, block)


class SelectiveStore(TieredStore):
    """One block file of whole blocks per (layer, sequence); chosen blocks or pages land in fixed staging slots."""

    def __init__(self, file: KVBlockFile, tier_of_layer: dict[int, int], batch_size: int, buffers: int = 1) -> None:
        super().__init__(file, tier_of_layer, batch_size)
        self._buffers = [self._staging] + [aligned_buffer(self._staging.nbytes) for _ in range(buffers - 1)]
        self._in_flight: list[Future] = []

    def all_blocks(self, layer: int, kinds: Iterable[int]) -> list[BlockId]:
        """Every stored block of `layer` of the given kinds, for all sequences."""
        return [(kind, seq, block) for kind in kinds for seq in range(self.batch_size)
                for block in range(self.stored_blocks[layer])]

    def read_tokens(self, layer: int, rows: Sequence[np.ndarray], kinds: tuple[int, ...], buffer: int = 0) -> None:
        """Read `kinds` of the stored pool indices in `rows` (one array per sequence) into `buffer` now.

        Indices past the stored tokens (in host DRAM) are ignored.
        """
        if self.file.page_checksums:
            self.file.read_pages(self._page_plan(layer, rows, kinds, buffer))
        else:
            self.read(layer, self._blocks_holding(layer, rows, kinds), buffer)

    def submit_tokens(self, layer: int, rows: Sequence[np.ndarray], kinds: tuple[int, ...], buffer: int = 0) -> Future:
        """`read_tokens` in the background; `.result()` waits and raises read or checksum errors."""
        if self.file.page_checksums:
            return self._track(self.file.submit_read_pages(self._page_plan(layer, rows, kinds, buffer)))
        return self.submit(layer, self._blocks_holding(layer, rows, kinds), buffer)

    def read(self, layer: int, blocks: Sequence[BlockId], buffer: int = 0) -> None:
        """Read `blocks` of `layer` into their slots of `buffer` now."""
        self.file.read_blocks(self._plan(layer, blocks, buffer))

    def submit(self, layer: int, blocks: Sequence[BlockId], buffer: int = 0) -> Future:
        """`read` in the background (I/O threads); `.result()` waits and raises read or checksum errors."""
        return self._track(self.file.submit_read_blocks(self._plan(layer, blocks, buffer)))

    def _track(self, future: Future) -> Future:
        self._in_flight = [pending for pending in self._in_flight if not pending.done()] + [future]
        return future

    def tokens(self, kind: int, buffer: int = 0) -> torch.Tensor:
        """[batch, capacity tokens, heads, head_dim] view of `kind` in `buffer`, token-major as stored."""
        per_kind = self.batch_size * self.blocks_per_seq * self.layout.block_bytes
        raw = self._buffers[buffer][kind * per_kind : (kind + 1) * per_kind]
        flat = torch.from_numpy(raw).view(self._torch_dtype)
        return flat.view(self.batch_size, self.blocks_per_seq * self._block_shape[0], *self._block_shape[1:])

    def _page_plan(self, layer: int, rows: Sequence[np.ndarray], kinds: tuple[int, ...],
                   buffer: int) -> list[tuple[int, int, int, np.ndarray, np.ndarray]]:
        """One page request per (kind, sequence): a sequence's blocks of a kind are adjacent in file and buffer."""
        stored, tier = self.stored_tokens(layer), self.tier_of_layer[layer]
        token_bytes = self.layout.block_bytes // self.layout.block_tokens
        region = self.blocks_per_seq * self.layout.block_bytes
        plan = []
        for kind in kinds:
            for seq, row in enumerate(rows):
                tokens = np.unique(row[row < stored])
                if tokens.size:
                    start = (kind * self.batch_size + seq) * region
                    plan.append((tier, kind, seq * self.blocks_per_seq,
                                 pages_holding(tokens, token_bytes, page=self.file.page_bytes),
                                 self._buffers[buffer][start : start + region]))
        return plan

    def _blocks_holding(self, layer: int, rows: Sequence[np.ndarray], kinds: tuple[int, ...]) -> list[BlockId]:
        """The (kind, sequence, block) of every stored block holding one of the pool indices."""
        stored, block = self.stored_tokens(layer), self.layout.block_tokens
        per_seq = [np.unique(row[row < stored] // block) for row in rows]
        return [(kind, seq, int(b)) for kind in kinds for seq, blocks in enumerate(per_seq) for b in blocks]

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
