"""The shared channel: its arrays and its lifetime."""

import os

import pytest

from kvtier.sparse.protocol import Channel, ChannelSpec


def test_closing_a_channel_releases_its_segment():
    channel = Channel.create(ChannelSpec(1, 2, 2, 1, 32, 100, kv_record_bytes=256, candidates=8))
    fd = channel.fd
    channel.found_records[1, 0, 7] = 5  # the last array is inside the segment
    channel.close()
    with pytest.raises(OSError):
        os.fstat(fd)  # the descriptor is gone, so is the memory once the scorer's copy goes too
    channel.close()  # twice is harmless


def test_the_kv_crcs_cover_the_file_in_its_smallest_read_unit():
    spec = ChannelSpec(2, 3, 2, 1, 32, 100, kv_record_bytes=256, candidates=8)
    channel = Channel.create(spec)
    try:
        assert spec.kv_pages * 512 == 3 * 2 * 100 * 256 + 3 * 2 * (-(100 * 256) % 4096)
        assert channel.kv_checksums(spec.kv_pages // 8, 4096).page == 4096
        with pytest.raises(ValueError, match="holds crcs for"):
            channel.kv_checksums(spec.kv_pages // 8 + 1, 4096)
    finally:
        channel.close()
