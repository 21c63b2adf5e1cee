"""The lookahead's candidates read by the scorer process: the best-scored slots, their K/V checked, handed over."""

import os
import signal

import numpy as np
import pytest
import torch

from kvtier.errors import ChecksumError
from kvtier.sparse.scorer.candidate_reads import CandidateReader, best
from kvtier.sparse.scorer.candidates_first import CandidatesFirst
from kvtier.sparse.cold.cold_pool import ColdPool, kv_record_bytes
from kvtier.sparse.protocol import AREAS, CONTROL_CANDIDATE_READ_BYTES, Channel, ChannelSpec
from kvtier.sparse.record_file import RecordFile, RecordLayout
from kvtier.sparse.scorer.client import ScorerClient
from kvtier.sparse.cold.sketch import SketchFormat, quantize, score
from kvtier.storage import IOEngine
from kvtier.storage.checksum import PageChecksums

LAYERS, BATCH, HEADS, HEAD_DIM, SLOTS, TOKENS, ROOM = 2, 2, 2, 32, 600, 500, 40
FMT = SketchFormat(8, HEADS, HEAD_DIM)


@pytest.fixture()
def pool(tmp_path):
    """A cold pool of TOKENS random tokens per (layer, sequence), its K|V crcs in a channel with candidate room."""
    channel = Channel.create(ChannelSpec(BATCH, LAYERS, HEADS, 1, HEAD_DIM, SLOTS,
                                         kv_record_bytes(HEADS, HEAD_DIM, torch.float32), ROOM))
    generator = torch.Generator().manual_seed(0)
    with IOEngine(2) as io:
        cold = ColdPool(str(tmp_path), LAYERS, BATCH, SLOTS, HEADS, HEAD_DIM, torch.float32, FMT, io, channel)
        kv = [(torch.randn(BATCH, HEADS, TOKENS, HEAD_DIM, generator=generator),
               torch.randn(BATCH, HEADS, TOKENS, HEAD_DIM, generator=generator)) for _ in range(LAYERS)]
        for layer, (keys, values) in enumerate(kv):
            cold.append(layer, keys, values, np.arange(TOKENS)[None, :].repeat(BATCH, axis=0))
        client = ScorerClient(channel, cold.sketches.path, cold.sketches.layout, FMT, "sum", 128, io_threads=2,
                              kv={"path": cold.kv.path, "layout": cold.kv.layout.to_dict(), "page": cold.kv.page})
        yield channel, cold, client, kv
        client.close()
        cold.close()
    channel.close()


def _query(seed):
    return np.random.default_rng(seed).standard_normal((BATCH, HEADS, 1, HEAD_DIM)).astype(np.float32)


def _check(cold, found, kv, layer, query, counts):
    """Each sequence got the `counts` slots its sketches score best under `query`, ascending, with the K/V written
    there."""
    keys, values = kv[layer]
    slots_by_seq, records, nbytes = found
    fetched = cold.fetched(slots_by_seq, records, int(nbytes.sum()))
    for seq, slots in enumerate(fetched.slots):
        scores = score(quantize(keys[seq].transpose(0, 1).numpy(), FMT), query[seq], FMT, "sum")
        assert slots.tolist() == sorted(np.argsort(-scores, kind="stable")[: counts[seq]].tolist())
        got_keys, got_values = fetched.of(seq)
        torch.testing.assert_close(got_keys, keys[seq][:, slots])
        torch.testing.assert_close(got_values, values[seq][:, slots])
        assert nbytes[seq] >= counts[seq] * cold.kv.layout.record_bytes


def test_the_scorer_reads_each_sequences_best_candidates(pool):
    channel, cold, client, kv = pool
    counts = np.array([ROOM, 7])
    client.request(1, _query(1), TOKENS, counts)
    found = client.candidates()
    _check(cold, found, kv, 1, _query(1), counts)
    _, _, nbytes = found
    assert channel.control[CONTROL_CANDIDATE_READ_BYTES] == nbytes.sum()
    assert client.host_scored_requests == 0 and client.process.poll() is None


def test_a_layers_candidates_stay_while_the_next_layers_are_read(pool):
    channel, cold, client, kv = pool
    counts = np.array([9, 9])
    client.request(0, _query(2), TOKENS, counts)
    slots, records, _ = client.candidates()
    kept = [seq_slots.copy() for seq_slots in slots], records.copy()
    client.request(1, _query(3), TOKENS, counts)
    client.candidates()
    for seq_slots, slots_then in zip(slots, kept[0]):
        np.testing.assert_array_equal(seq_slots, slots_then)
    np.testing.assert_array_equal(records, kept[1])


def test_a_damaged_candidate_page_is_an_error_not_an_answer(pool):
    channel, cold, client, kv = pool
    client.request(0, _query(4), TOKENS, np.array([ROOM, ROOM]))
    slots, _, _ = client.candidates()
    slot = int(slots[1][0])
    offset = cold.kv.layout.region_offset(0, 1) + slot * cold.kv.layout.record_bytes + 3
    fd = os.open(cold.kv.path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 0xFF]), offset)
    finally:
        os.close(fd)
    client.request(0, _query(4), TOKENS, np.array([ROOM, ROOM]))  # the same query: the same slot again
    with pytest.raises(ChecksumError, match="layer 0 sequence 1: checksum mismatch"):
        client.candidates()  # the scorer failed the request; the host's retry fails the same check and says so


def test_a_scorer_killed_mid_request_leaves_the_host_the_same_candidates(pool):
    channel, cold, client, kv = pool
    counts = np.array([12, ROOM])
    client.request(1, _query(5), TOKENS, counts)
    client.candidates()
    os.kill(client.process.pid, signal.SIGKILL)
    client.process.wait()
    client.request(1, _query(5), TOKENS, counts)
    found = client.candidates()
    assert client.host_scored_requests == 1
    _check(cold, found, kv, 1, _query(5), counts)


def test_requests_sent_before_the_first_is_answered_are_answered_in_order(pool):
    _, cold, client, kv = pool
    counts = np.array([11, 30])
    layers = [layer % LAYERS for layer in range(AREAS)]
    for seed, layer in enumerate(layers):  # each sent while the scorer may still read the ones before
        client.request(layer, _query(seed), TOKENS, counts)
    with pytest.raises(RuntimeError, match=f"{AREAS} requests unanswered"):
        client.request(0, _query(9), TOKENS, counts)
    for seed, layer in enumerate(layers):
        _check(cold, client.candidates(), kv, layer, _query(seed), counts)
    assert client.host_scored_requests == 0


@pytest.mark.parametrize("death", ["before the requests", "inside the first"])
def test_a_scorer_that_dies_with_two_requests_sent_answers_both_the_same(pool, death):
    channel, cold, client, kv = pool
    if death == "inside the first":  # a scorer that kills itself in the first request's second sequence
        client.close()
        client = ScorerClient(channel, cold.sketches.path, cold.sketches.layout, FMT, "sum", 128, io_threads=2,
                              crash_after_blocks=6, kv={"path": cold.kv.path, "layout": cold.kv.layout.to_dict(),
                                                        "page": cold.kv.page})
    else:
        os.kill(client.process.pid, signal.SIGKILL)
        client.process.wait()
    counts = np.array([ROOM, 5])
    try:
        client.request(1, _query(10), TOKENS, counts)
        client.request(0, _query(11), TOKENS, counts)
        _check(cold, client.candidates(), kv, 1, _query(10), counts)  # done on the host
        _check(cold, client.candidates(), kv, 0, _query(11), counts)  # sent again to the replacement
        assert client.host_scored_requests == 1 and client.restarts == 1
    finally:
        client.close()


def test_more_candidates_than_the_channel_holds_are_refused(pool):
    _, _, client, _ = pool
    with pytest.raises(ValueError, match=f"room for {ROOM}"):
        client.request(0, _query(6), TOKENS, np.array([ROOM + 1, 1]))


def test_best_takes_the_highest_scores():
    scores = np.array([0.5, 3.0, -1.0, 2.0])
    assert best(scores, 2).tolist() == [1, 3]  # ascending
    assert best(scores, 0).size == 0 and best(scores, 9).tolist() == [0, 1, 2, 3]


def test_candidates_are_read_where_their_bytes_lie_the_run_or_a_stored_image(tmp_path):
    record = kv_record_bytes(HEADS, HEAD_DIM, torch.float32)
    channel = Channel.create(ChannelSpec(1, 1, HEADS, 1, HEAD_DIM, 64, record, 16))
    layout = RecordLayout(record, 1, 1, 64)
    rng = np.random.default_rng(7)
    image_records, own_records = (rng.integers(0, 256, (64, record), dtype=np.uint8) for _ in range(2))
    with IOEngine(2) as io, IOEngine(2) as stored_io:
        written = RecordFile(str(tmp_path / "image.kv"), layout, io, page_checksums=PageChecksums)
        written.write_records(0, 0, np.arange(64), image_records)
        written.close()
        image = RecordFile(written.path, layout, stored_io, stored_pages=written.pages)
        own = RecordFile(str(tmp_path / "own.kv"), layout, io, page_checksums=channel.kv_checksums)
        rewritten = np.array([3, 10, 11])  # slots the run has written since: they are read from its own file
        own.write_records(0, 0, rewritten, own_records[rewritten])
        channel.overlay[0, 0, rewritten] = 1
        channel.results["score"][0, 0, :64] = np.arange(64)[::-1]  # request area 0's: slot 0 best
        channel.counts[0, 0] = 12
        CandidateReader(channel, 0, own, image).submit(0, 64)()
        expected = image_records[:12].copy()
        expected[rewritten[rewritten < 12]] = own_records[rewritten[rewritten < 12]]
        assert channel.found_slots[0, 0, :12].tolist() == list(range(12))
        np.testing.assert_array_equal(channel.found_records[0, 0, :12], expected)
        own.remove()
        own.pages = None
        image.close()
    channel.close()


@pytest.mark.parametrize("damaged", [False, True])
def test_candidate_reads_hold_the_sketch_read_ahead_until_they_land_or_fail(tmp_path, damaged, quiet_waiter):
    record = kv_record_bytes(HEADS, HEAD_DIM, torch.float32)
    channel = Channel.create(ChannelSpec(1, 1, HEADS, 1, HEAD_DIM, 64, record, 16))
    with IOEngine(2) as io:
        own = RecordFile(str(tmp_path / "own.kv"), RecordLayout(record, 1, 1, 64), io,
                         page_checksums=channel.kv_checksums)
        own.write_records(0, 0, np.arange(64), np.random.default_rng(3).integers(0, 256, (64, record), dtype=np.uint8))
        if damaged:
            fd = os.open(own.path, os.O_RDWR)
            os.pwrite(fd, bytes([os.pread(fd, 1, 5)[0] ^ 0xFF]), 5)  # in slot 0, the best
            os.close(fd)
        channel.results["score"][0, 0, :64] = np.arange(64)[::-1]
        channel.counts[0, 0] = 4
        first = CandidatesFirst()
        fill = CandidateReader(channel, 0, own, first=first).submit(0, 64)
        returned = quiet_waiter(first)
        assert not returned.wait(0.2)  # queued, not yet waited for
        if damaged:
            with pytest.raises(ChecksumError):
                fill()
        else:
            fill()
        assert returned.wait(10)
        own.remove()
    channel.close()
