"""The accuracy grids (the benchmark runs end to end in tests/commands/test_bench_accuracy.py)."""

from kvtier.eval.accuracy.accuracy_bench import full_contexts
from kvtier.eval.accuracy.accuracy_grid import GRIDS


def test_full_grid_doubles_contexts_up_to_the_usable_context():
    assert full_contexts(8192, 256) == (1024, 2048, 4096, 7936)
    assert full_contexts(32768, 256)[-2:] == (16384, 32512)
    assert GRIDS["small"].contexts and GRIDS["full"].contexts is None
