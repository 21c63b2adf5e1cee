"""The scorer prepares the next layer ahead of its query, and never scores a prepared layer the host rewrote."""

import numpy as np
import pytest

from kvtier.sparse.protocol import CONTROL_COLD_TOKENS, CONTROL_SCORER_READ_BYTES, Channel, ChannelSpec
from kvtier.sparse.record_file import RecordFile, RecordLayout, open_for_reading
from kvtier.sparse.sketch import SketchFormat, quantize, score
from kvtier.sparse.sketch_scorer import SketchScorer
from kvtier.storage import IOEngine

FMT = SketchFormat(8, 2, 32)
TOKENS = 300


@pytest.fixture()
def scorer(tmp_path):
    rng = np.random.default_rng(0)
    channel = Channel.create(ChannelSpec(1, 2, 2, 1, 32, 400))
    layout = RecordLayout(FMT.record_bytes, 2, 1, 400)
    with IOEngine(2) as io:
        file = RecordFile(str(tmp_path / "sketches"), layout, io)
        keys = rng.standard_normal((2, TOKENS, 2, 32)).astype(np.float32)
        for layer in range(2):
            file.write_records(layer, 0, np.arange(TOKENS), quantize(keys[layer], FMT))
        channel.cold_used[:] = TOKENS
        channel.query[:] = rng.standard_normal(channel.query.shape)
        channel.control[CONTROL_COLD_TOKENS] = TOKENS
        fd, _ = open_for_reading(file.path)
        yield SketchScorer(fd, layout, FMT, channel, "sum", 64, io), channel, file, keys
        file.remove()
    channel.close()


def _read_bytes(channel):
    return int(channel.control[CONTROL_SCORER_READ_BYTES])


def test_a_prepared_layer_is_scored_without_reading_again(scorer):
    sketch_scorer, channel, _, keys = scorer
    sketch_scorer.prepare(1)
    read = _read_bytes(channel)
    assert read > 0
    sketch_scorer.score_layer(1)
    assert _read_bytes(channel) == read
    expected = score(quantize(keys[1], FMT), channel.query[0], FMT, "sum")
    np.testing.assert_array_equal(channel.results[0, :TOKENS]["score"], expected)
    sketch_scorer.score_layer(0)  # not the prepared layer: read now
    assert _read_bytes(channel) > read


def test_a_layer_rewritten_after_preparing_is_read_again(scorer):
    sketch_scorer, channel, file, keys = scorer
    sketch_scorer.prepare(0)
    changed = keys[0].copy()
    changed[5] *= -3
    file.write_records(0, 0, [5], quantize(changed[5:6], FMT))
    channel.versions[0] += 1  # what the host does after every write
    read = _read_bytes(channel)
    sketch_scorer.score_layer(0)
    assert _read_bytes(channel) > read
    np.testing.assert_array_equal(channel.results[0, :TOKENS]["score"],
                                  score(quantize(changed, FMT), channel.query[0], FMT, "sum"))


def test_preparing_a_layer_that_is_still_prepared_reads_nothing(scorer):
    sketch_scorer, channel, _, _ = scorer
    sketch_scorer.prepare(1)
    read = _read_bytes(channel)
    sketch_scorer.prepare(1)
    assert _read_bytes(channel) == read
    channel.versions[1] += 1  # rewritten: prepared again
    sketch_scorer.prepare(1)
    assert _read_bytes(channel) > read
