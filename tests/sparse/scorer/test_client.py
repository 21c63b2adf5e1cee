"""The storage scorer as a real process: protocol, streamed blocks, and what happens when it dies."""

import os
import signal

import numpy as np
import pytest

from kvtier.sparse.protocol import CONTROL_SCORER_READ_BYTES, Channel, ChannelSpec
from kvtier.sparse.record_file import RecordFile, RecordLayout
from kvtier.sparse.scorer.client import ScorerClient
from kvtier.sparse.cold.sketch import SketchFormat, quantize, score
from kvtier.storage import IOEngine
from kvtier.sparse.threads import decoding, scorer_core

LAYERS, BATCH, SLOTS, TOKENS, BLOCK = 2, 2, 1000, 700, 64
FMT = SketchFormat(8, 2, 32)


@pytest.fixture()
def pool(tmp_path):
    """A sketch file with TOKENS random keys per (layer, sequence), positions published in a channel."""
    rng = np.random.default_rng(0)
    channel = Channel.create(ChannelSpec(BATCH, LAYERS, 2, 1, 32, SLOTS))
    layout = RecordLayout(FMT.record_bytes, LAYERS, BATCH, SLOTS)
    io = IOEngine(2)
    file = RecordFile(str(tmp_path / "sketches"), layout, io)
    keys = rng.standard_normal((LAYERS, BATCH, TOKENS, 2, 32)).astype(np.float32)
    for layer in range(LAYERS):
        for seq in range(BATCH):
            file.write_records(layer, seq, np.arange(TOKENS), quantize(keys[layer, seq], FMT))
            channel.positions[layer, seq, :TOKENS] = np.arange(TOKENS) * 3 + seq  # any labels will do
    query = rng.standard_normal(channel.query.shape[1:]).astype(np.float32)
    yield channel, file, keys, query
    file.remove()
    io.close()
    channel.close()


def _expected(query, keys, layer, seq):
    return score(quantize(keys[layer, seq], FMT), query[seq], FMT, "sum")


def _client(channel, file, **options):
    return ScorerClient(channel, file.path, file.layout, FMT, "sum", BLOCK, io_threads=2, **options)


def test_scores_stream_back_as_position_score_blocks(pool):
    channel, file, keys, query = pool
    client = _client(channel, file)
    try:
        client.request(1, query, TOKENS)
        scores = client.scores()
        area = 1  # the first request's
        for seq in range(BATCH):
            results = channel.results[area, seq, :TOKENS]
            np.testing.assert_array_equal(scores[seq], _expected(query, keys, 1, seq))
            np.testing.assert_array_equal(results["score"], scores[seq])
            np.testing.assert_array_equal(results["position"], np.arange(TOKENS) * 3 + seq)
        assert list(channel.progress[area]) == [-(-TOKENS // BLOCK)] * BATCH
        assert channel.control[CONTROL_SCORER_READ_BYTES] >= BATCH * TOKENS * FMT.record_bytes
        assert client.host_scored_requests == 0 and client.process.poll() is None
    finally:
        client.close()
    assert client.process is None



def test_an_empty_request_is_a_cheap_round_trip(pool):
    channel, file, _, _ = pool
    client = _client(channel, file)
    try:
        assert client.round_trip_s(repeats=20) < 0.5  # a sanity bound only; the benchmark reports the real figure
        assert client.host_scored_requests == 0
        client.request(0, np.zeros(channel.query.shape[1:], dtype=np.float32), 0)  # an answer not taken yet
        with pytest.raises(RuntimeError, match="1 requests unanswered"):
            client.round_trip_s(repeats=1)  # it would time that answer, not its own
    finally:
        client.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning apart needs two cores")
def test_the_scorer_and_its_replacement_run_on_the_core_the_decode_keeps_free(pool):
    channel, file, keys, query = pool
    client = _client(channel, file)
    try:
        core = scorer_core()
        assert os.sched_getaffinity(client.process.pid) == {core}
        with decoding("sparse"):
            assert core not in os.sched_getaffinity(0)
            os.kill(client.process.pid, signal.SIGKILL)  # replaced from inside the decode
            client.request(0, query, TOKENS)
            np.testing.assert_array_equal(client.scores()[0], _expected(query, keys, 0, 0))
            assert client.restarts == 1 and os.sched_getaffinity(client.process.pid) == {core}
    finally:
        client.close()


def test_ctrl_c_leaves_the_scorer_serving_until_the_host_stops_it(pool):
    """Ctrl-C goes to the terminal's whole process group: the scorer ignores it (no traceback of its own), the host's
    `close` stops it."""
    channel, file, keys, query = pool
    client = _client(channel, file)
    try:
        scorer = client.process
        os.kill(scorer.pid, signal.SIGINT)
        client.request(0, query, TOKENS)
        np.testing.assert_array_equal(client.scores()[0], _expected(query, keys, 0, 0))
        assert client.restarts == 0 and client.host_scored_requests == 0
    finally:
        client.close()
    assert scorer.returncode == 0


def test_a_killed_scorer_is_noticed_replaced_and_its_layer_scored_on_the_host(pool):
    channel, file, keys, query = pool
    client = _client(channel, file)
    try:
        first = client.process
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        client.request(0, query, TOKENS)
        scores = client.scores()
        np.testing.assert_array_equal(scores[1], _expected(query, keys, 0, 1))
        assert client.host_scored_requests == 1 and client.restarts == 1
        assert client.process is not first and client.process.poll() is None
        client.request(1, query, TOKENS)  # the replacement serves the next request
        scores = client.scores()
        np.testing.assert_array_equal(scores[0], _expected(query, keys, 1, 0))
        assert client.host_scored_requests == 1
    finally:
        client.close()


def test_a_scorer_dying_mid_request_is_resumed_from_its_last_block(pool):
    channel, file, keys, query = pool
    client = _client(channel, file, crash_after_blocks=5)  # dies inside sequence 0's blocks
    try:
        client.request(1, query, TOKENS)
        scores = client.scores()
        assert client.host_scored_requests == 1
        for seq in range(BATCH):
            np.testing.assert_array_equal(scores[seq], _expected(query, keys, 1, seq))
    finally:
        client.close()


def test_after_max_restarts_the_host_keeps_scoring(pool):
    channel, file, keys, query = pool
    client = _client(channel, file, max_restarts=0)
    try:
        os.kill(client.process.pid, signal.SIGKILL)
        client.process.wait()
        for layer in (0, 1):
            client.request(layer, query, TOKENS)
            scores = client.scores()
            np.testing.assert_array_equal(scores[0], _expected(query, keys, layer, 0))
        assert client.process is None and client.host_scored_requests == 2
    finally:
        client.close()


def test_a_replacement_that_does_not_start_leaves_the_host_scoring(pool, monkeypatch):
    channel, file, keys, query = pool
    client = _client(channel, file)
    try:
        os.kill(client.process.pid, signal.SIGKILL)
        client.process.wait()
        monkeypatch.setattr("kvtier.sparse.scorer.client.sys.executable", "/bin/false")  # the restart exits at once
        for layer in (0, 1):
            client.request(layer, query, TOKENS)
            scores = client.scores()
            np.testing.assert_array_equal(scores[1], _expected(query, keys, layer, 1))
        assert client.process is None and client.restarts == 1 and client.host_scored_requests == 2
    finally:
        client.close()


def test_memory_budget_keeps_sketches_until_the_layer_is_rewritten(pool):
    channel, file, keys, query = pool
    client = _client(channel, file, memory_budget=10 * 2**20)
    try:
        for _ in range(2):
            client.request(0, query, TOKENS)
            client.scores()
        read_once = channel.control[CONTROL_SCORER_READ_BYTES]
        assert read_once == BATCH * file.layout.prefix_bytes(TOKENS)  # the second request came from memory
        channel.versions[0] += 1  # the host rewrote layer 0
        client.request(0, query, TOKENS)
        scores = client.scores()
        assert channel.control[CONTROL_SCORER_READ_BYTES] == 2 * read_once
        np.testing.assert_array_equal(scores[1], _expected(query, keys, 0, 1))
    finally:
        client.close()
