"""The windowed skeleton's window: distribution keeps sink + recent, retirement hands the leaving tokens back."""

import numpy as np
import torch

from kvtier.kv.windowed import WindowedLayer


class _Pool(WindowedLayer):
    """A skeleton whose pool only notes what distribution placed."""

    def make_pool(self, batch: int, heads: int, head_dim: int) -> None:
        self.placed = None

    def place(self, pool: slice) -> None:
        self.placed = pool

    def pool_tokens(self) -> tuple[int, int]:
        return 0, 0


def _tokens(first: int, count: int) -> torch.Tensor:
    """K or V [1, 1, count, 1] whose values are their positions."""
    return torch.arange(first, first + count, dtype=torch.float32).view(1, 1, count, 1)


def test_retiring_hands_back_the_tokens_past_the_recent_window_a_batch_at_a_time():
    layer = _Pool(0, max_tokens=64, sink=2, kept_recent=4, retire_batch=3)
    layer.update(_tokens(0, 10), _tokens(0, 10))  # the prompt
    layer.update(_tokens(10, 1), _tokens(10, 1))  # the first decode step distributes it
    assert layer.placed == slice(2, 6) and layer.window_positions.tolist() == [0, 1, 6, 7, 8, 9, 10]
    assert layer.retire() is None  # one token past the recent 4: fewer than a batch
    layer.update(_tokens(11, 1), _tokens(11, 1))
    assert layer.retire() is None
    layer.update(_tokens(12, 1), _tokens(12, 1))
    retired = layer.retire()
    assert retired.positions.tolist() == [6, 7, 8] and retired.keys.flatten().tolist() == [6.0, 7.0, 8.0]
    assert torch.equal(retired.values, retired.keys)
    assert layer.window_positions.tolist() == [0, 1, 9, 10, 11, 12]  # sink + the recent 4
    assert np.array_equal(layer.keys.flatten().numpy(), layer.window_positions.astype(np.float32))
