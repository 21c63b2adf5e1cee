"""The scorer prepares the next layer while it scores this one, and never scores a prepared layer the host
rewrote."""

import os

import numpy as np
import pytest

from kvtier.sparse.protocol import CONTROL_SCORER_READ_BYTES, Channel, ChannelSpec
from kvtier.sparse.record_file import RecordFile, RecordLayout, open_for_reading
from kvtier.sparse.cold.sketch import SketchFormat, quantize, score
from kvtier.sparse.scorer.sketch_scorer import SketchScorer
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
        fd, _ = open_for_reading(file.path)
        sketch_scorer = SketchScorer(fd, layout, FMT, channel, "sum", 64, io)
        yield sketch_scorer, channel, file, keys
        sketch_scorer.close()
        file.remove()
    channel.close()


def _read_bytes(channel):
    return int(channel.control[CONTROL_SCORER_READ_BYTES])


def _scores(channel):
    return channel.results[0, 0, :TOKENS]["score"].copy()  # request area 0's, sequence 0's


def _expected(layer_keys, channel):
    """What sequence 0's scores must be for a layer holding `layer_keys`."""
    return score(quantize(layer_keys, FMT), channel.query[0, 0], FMT, "sum")


def test_a_prepared_layer_is_read_once_no_candidate_read_is_in_flight(scorer):
    sketch_scorer, channel, _, keys = scorer
    sketch_scorer.first.begin()
    try:
        reading = sketch_scorer.prepare(1)
        with pytest.raises(TimeoutError):
            reading.result(timeout=0.2)
        assert _read_bytes(channel) == 0
    finally:
        sketch_scorer.first.end()
    reading.result(timeout=10)
    sketch_scorer.score_layer(1, 0, TOKENS)
    np.testing.assert_array_equal(_scores(channel), _expected(keys[1], channel))


def test_a_request_reads_its_layer_even_while_candidate_reads_are_in_flight(scorer):
    sketch_scorer, channel, _, keys = scorer
    sketch_scorer.first.begin()
    try:
        sketch_scorer.score_layer(0, 0, TOKENS)  # what the host waits for does not wait
    finally:
        sketch_scorer.first.end()
    np.testing.assert_array_equal(_scores(channel), _expected(keys[0], channel))


def test_a_prepared_layer_is_scored_without_reading_again(scorer):
    sketch_scorer, channel, _, keys = scorer
    sketch_scorer.prepare(1).result()
    read = _read_bytes(channel)
    assert read > 0
    sketch_scorer.score_layer(1, 0, TOKENS)
    assert _read_bytes(channel) == read
    np.testing.assert_array_equal(_scores(channel), _expected(keys[1], channel))
    sketch_scorer.score_layer(0, 0, TOKENS)  # not the prepared layer: read now
    assert _read_bytes(channel) > read


def test_a_layer_rewritten_after_preparing_is_read_again(scorer):
    sketch_scorer, channel, file, keys = scorer
    sketch_scorer.prepare(0).result()
    changed = keys[0].copy()
    changed[5] *= -3
    file.write_records(0, 0, [5], quantize(changed[5:6], FMT))
    channel.versions[0] += 1  # what the host does after every write
    read = _read_bytes(channel)
    sketch_scorer.score_layer(0, 0, TOKENS)
    assert _read_bytes(channel) > read
    np.testing.assert_array_equal(_scores(channel), _expected(changed, channel))


def test_preparing_a_layer_that_is_still_prepared_reads_nothing(scorer):
    sketch_scorer, channel, _, _ = scorer
    sketch_scorer.prepare(1).result()
    read = _read_bytes(channel)
    sketch_scorer.prepare(1).result()
    assert _read_bytes(channel) == read
    channel.versions[1] += 1  # rewritten: prepared again
    sketch_scorer.prepare(1).result()
    assert _read_bytes(channel) > read


def test_layers_prepared_while_others_are_scored_keep_their_own_buffers(scorer):
    sketch_scorer, channel, _, keys = scorer
    sketch_scorer.score_layer(0, 0, TOKENS, then_prepare=1)  # layer 1 is read while layer 0 is scored
    np.testing.assert_array_equal(_scores(channel), _expected(keys[0], channel))
    # wait for the background read (a current prepared layer is not read again): its bytes count when it ends
    sketch_scorer.prepare(1).result()
    one_layer = _read_bytes(channel) // 2  # layer 0 read by the request, layer 1 prepared
    sketch_scorer.score_layer(1, 0, TOKENS, then_prepare=0)
    np.testing.assert_array_equal(_scores(channel), _expected(keys[1], channel))
    sketch_scorer.prepare(0).result()
    read = _read_bytes(channel)
    assert read == 3 * one_layer  # no layer read twice
    sketch_scorer.score_layer(0, 0, TOKENS)  # prepared while layer 1 was scored, into the other buffers
    assert _read_bytes(channel) == read
    np.testing.assert_array_equal(_scores(channel), _expected(keys[0], channel))


class _FailingReads(IOEngine):
    def read_runs(self, fd, runs):
        raise OSError(5, "injected read failure")


def test_a_failed_prepare_is_read_again_by_the_request(scorer, capfd):
    _, channel, file, keys = scorer
    fd, _ = open_for_reading(file.path)
    with IOEngine(1) as io, _FailingReads(1) as failing:
        sketch_scorer = SketchScorer(fd, file.layout, FMT, channel, "sum", 64, io, prefetch_io=failing)
        try:
            assert isinstance(sketch_scorer.prepare(1).exception(), OSError)
            sketch_scorer.score_layer(1, 0, TOKENS)
        finally:
            sketch_scorer.close()
            os.close(fd)
    np.testing.assert_array_equal(_scores(channel), _expected(keys[1], channel))
    assert "injected read failure" in capfd.readouterr().err
