import os
import threading

import numpy as np
import pytest

from kvtier.errors import ChecksumError, ConfigError, StorageError
from kvtier.storage.aligned import aligned_buffer
from kvtier.storage.block_file import KVBlockFile
from kvtier.storage.checksum import ChecksumTable, checksum
from kvtier.storage.geometry import PAGE, K, KVGeometry, V
from kvtier.storage.io_engine import IOEngine

# 2 heads x 64 dims x fp16 x 16 tokens = 4096 bytes: blocks fill pages exactly.
ALIGNED = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=64, dtype="float16")
# 3 heads x 64 dims x fp16 x 16 tokens = 6144 bytes: every block is padded to 8192.
PADDED = KVGeometry(num_layers=2, num_kv_heads=3, head_dim=64, dtype="float16")
# 2 heads x 64 dims x fp32 x 16 tokens = 8192 bytes: two pages per block, for page reads.
TWO_PAGES = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32")
TOKENS, BLOCKS = 16, 8


@pytest.fixture
def engine():
    with IOEngine(threads=4) as engine:
        yield engine


def create(directory, geometry=ALIGNED, io=None, model_id="test-model"):
    return KVBlockFile.create(directory / "kv.bin", geometry, TOKENS, BLOCKS, model_id, io=io)


def random_blocks(layout, keys, rng, aligned=True):
    """(layer, kind, block, buffer) with random data; unaligned buffers start one byte into a page."""
    blocks = []
    for layer, kind, block in keys:
        if aligned:
            buf = aligned_buffer(layout.block_bytes)
        else:
            buf = aligned_buffer(layout.block_bytes + 1)[1:]
        buf[:] = rng.integers(0, 256, layout.block_bytes, dtype=np.uint8)
        blocks.append((layer, kind, block, buf))
    return blocks


def empty_like(blocks, aligned=True):
    return [(layer, kind, block, aligned_buffer(buf.nbytes) if aligned else aligned_buffer(buf.nbytes + 1)[1:])
            for layer, kind, block, buf in blocks]


def assert_same_data(expected, actual):
    for (layer, kind, block, want), (*_, got) in zip(expected, actual):
        assert (want == got).all(), f"layer {layer} kind {kind} block {block} differs"


def all_keys(geometry=ALIGNED):
    return [(layer, kind, block) for layer in range(geometry.num_layers) for kind in (K, V) for block in range(BLOCKS)]


def test_create_preallocates_and_lays_out_the_file(direct_dir):
    with create(direct_dir) as kv:
        layout = kv.layout
        assert kv.direct
        assert layout.data_offset == PAGE + ChecksumTable.nbytes_for(3 * 2 * BLOCKS) == 2 * PAGE
        stat = os.stat(kv.path)
        assert stat.st_size == layout.file_bytes == 2 * PAGE + 3 * 2 * BLOCKS * PAGE
        assert stat.st_blocks * 512 >= layout.file_bytes  # space reserved, not a sparse file
        assert kv.model_id == "test-model"


def test_round_trip_of_all_blocks_in_scattered_order(direct_dir, engine, rng):
    with create(direct_dir, io=engine) as kv:
        keys = all_keys()
        order = rng.permutation(len(keys))
        blocks = random_blocks(kv.layout, [keys[i] for i in order], rng)
        kv.write_blocks(blocks)
        scattered = [blocks[i] for i in rng.permutation(len(blocks))]
        out = empty_like(scattered)
        kv.read_blocks(out)
        assert_same_data(scattered, out)
    with KVBlockFile.open(direct_dir / "kv.bin", ALIGNED, TOKENS, "test-model") as reopened:
        out = empty_like(blocks)
        reopened.read_blocks(out)
        assert_same_data(blocks, out)


def test_counters_equal_the_bytes_moved(direct_dir, engine, rng):
    with create(direct_dir, io=engine) as kv:
        # two runs: blocks 0-3 of layer 0 K, and block 6 of layer 2 V
        blocks = random_blocks(kv.layout, [(0, K, b) for b in range(4)] + [(2, V, 6)], rng)
        before = engine.stats.snapshot()
        kv.write_blocks(blocks)
        written = engine.stats.minus(before)
        assert written.bytes_written == 5 * PAGE + PAGE  # five blocks and one checksum-table page
        assert written.write_calls == 2 + 1
        assert (written.bytes_read, written.read_calls, written.bounce_copies) == (0, 0, 0)
        before = engine.stats.snapshot()
        kv.read_blocks(empty_like(blocks))
        read = engine.stats.minus(before)
        assert (read.bytes_read, read.read_calls, read.bytes_written, read.bounce_copies) == (5 * PAGE, 2, 0, 0)


def test_adjacent_blocks_coalesce_across_kind_and_layer(direct_dir, engine, rng):
    with create(direct_dir, io=engine) as kv:
        keys = [(0, K, BLOCKS - 1), (0, V, 0), (0, V, BLOCKS - 1), (1, K, 0), (1, K, 1)]
        blocks = random_blocks(kv.layout, keys, rng)
        kv.write_blocks(blocks)
        before = engine.stats.snapshot()
        out = empty_like(blocks)
        kv.read_blocks(out)
        assert engine.stats.minus(before).read_calls == 2  # [0K7, 0V0] and [0V7, 1K0, 1K1]
        assert_same_data(blocks, out)


def test_unaligned_buffers_go_through_bounce_buffers(direct_dir, engine, rng):
    with create(direct_dir, io=engine) as kv:
        blocks = random_blocks(kv.layout, [(1, K, b) for b in range(5)], rng, aligned=False)
        before = engine.stats.snapshot()
        kv.write_blocks(blocks)
        out = empty_like(blocks, aligned=False)
        kv.read_blocks(out)
        moved = engine.stats.minus(before)
        assert moved.bounce_copies == 10
        assert moved.read_calls == 1 and moved.bytes_read == 5 * PAGE
        assert_same_data(blocks, out)


def test_padded_blocks_round_trip_and_leave_zero_padding(direct_dir, engine, rng):
    with KVBlockFile.create(direct_dir / "kv.bin", PADDED, TOKENS, BLOCKS, "m", io=engine) as kv:
        assert (kv.layout.block_bytes, kv.layout.block_stride) == (6144, 8192)
        blocks = random_blocks(kv.layout, [(1, V, 2), (1, V, 3), (0, K, 0)], rng)
        before = engine.stats.snapshot()
        kv.write_blocks(blocks)
        out = empty_like(blocks)
        kv.read_blocks(out)
        moved = engine.stats.minus(before)
        assert moved.bounce_copies == 6
        assert moved.bytes_read == 3 * 8192 and moved.read_calls == 2
        assert_same_data(blocks, out)
        offset = kv.layout.offset(1, V, 2)
    with open(direct_dir / "kv.bin", "rb") as file:
        file.seek(offset + 6144)
        assert file.read(2048) == bytes(2048)


def test_filesystem_without_o_direct_uses_buffered_io(no_direct_dir, engine, rng):
    with create(no_direct_dir, io=engine) as kv:
        assert not kv.direct
        blocks = random_blocks(kv.layout, [(2, K, 1), (0, V, 7)], rng, aligned=False)
        before = engine.stats.snapshot()
        kv.write_blocks(blocks)
        out = empty_like(blocks, aligned=False)
        kv.read_blocks(out)
        assert engine.stats.minus(before).bounce_copies == 0  # buffered I/O takes any address
        assert_same_data(blocks, out)
    with KVBlockFile.open(no_direct_dir / "kv.bin") as reopened:
        assert not reopened.direct
        out = empty_like(blocks)
        reopened.read_blocks(out)
        assert_same_data(blocks, out)


def test_many_threads_writing_disjoint_blocks(direct_dir, engine, rng):
    keys = all_keys()
    with create(direct_dir, io=engine) as kv:
        blocks = random_blocks(kv.layout, keys, rng)
        shares = [blocks[i::4] for i in range(4)]  # interleaved: all share checksum-table page 0
        threads = [threading.Thread(target=kv.write_blocks, args=(share,)) for share in shares]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    with KVBlockFile.open(direct_dir / "kv.bin", io=engine) as reopened:
        out = empty_like(blocks)
        reopened.read_blocks(out)
        assert_same_data(blocks, out)


def test_flipped_byte_on_disk_raises_checksum_error(direct_dir, rng):
    with create(direct_dir) as kv:
        blocks = random_blocks(kv.layout, [(1, V, 3), (1, V, 4)], rng)
        kv.write_blocks(blocks)
        offset = kv.layout.offset(1, V, 3) + 123
    with open(direct_dir / "kv.bin", "r+b") as file:
        file.seek(offset)
        original = file.read(1)[0]
        file.seek(offset)
        file.write(bytes([original ^ 0x40]))
    damaged = blocks[0][3].copy()
    damaged[123] ^= 0x40
    expected = (f"{direct_dir / 'kv.bin'}: checksum mismatch in layer 1 V block 3 "
                f"(stored 0x{checksum(blocks[0][3]):08x}, read 0x{checksum(damaged):08x})")
    with KVBlockFile.open(direct_dir / "kv.bin") as kv:
        with pytest.raises(ChecksumError) as error:
            kv.read_blocks(empty_like(blocks))
        assert str(error.value).startswith(expected)
        out = empty_like(blocks[1:])
        kv.read_blocks(out)  # the neighbour is intact
        assert_same_data(blocks[1:], out)


def test_reading_a_never_written_block_fails(direct_dir, rng):
    with create(direct_dir) as kv:
        kv.write_blocks(random_blocks(kv.layout, [(0, K, 0)], rng))
        with pytest.raises(StorageError, match=r"kv.bin: layer 0 K block 1 was never written"):
            kv.read_blocks(empty_like(random_blocks(kv.layout, [(0, K, 0), (0, K, 1)], rng)))


def test_async_read_fills_buffers_and_reports_errors(direct_dir, engine, rng):
    with create(direct_dir, io=engine) as kv:
        blocks = random_blocks(kv.layout, [(2, K, b) for b in range(BLOCKS)], rng)
        kv.write_blocks(blocks)
        out = empty_like(blocks)
        future = kv.submit_read_blocks(out)
        assert future.result(timeout=30) is None
        assert_same_data(blocks, out)
        failing = kv.submit_read_blocks(empty_like(random_blocks(kv.layout, [(2, V, 0)], rng)))
        with pytest.raises(StorageError, match="layer 2 V block 0 was never written"):
            failing.result(timeout=30)


def test_async_read_reports_checksum_errors(direct_dir, rng):
    with create(direct_dir) as kv:
        blocks = random_blocks(kv.layout, [(0, V, 5)], rng)
        kv.write_blocks(blocks)
        offset = kv.layout.offset(0, V, 5)
    with open(direct_dir / "kv.bin", "r+b") as file:
        file.seek(offset)
        file.write(b"\xff\xff")
    with KVBlockFile.open(direct_dir / "kv.bin") as kv:
        with pytest.raises(ChecksumError, match="checksum mismatch in layer 0 V block 5"):
            kv.submit_read_blocks(empty_like(blocks)).result(timeout=30)


def test_bad_requests_are_programming_errors(direct_dir, rng):
    with create(direct_dir) as kv:
        block = random_blocks(kv.layout, [(0, K, 0)], rng)[0]
        with pytest.raises(ValueError, match="layer 0 K block 0: buffer has 10 bytes, a block has 4096"):
            kv.write_blocks([(0, K, 0, bytes(10))])
        with pytest.raises(ValueError, match="the same block twice"):
            kv.write_blocks([block, block])
        with pytest.raises(ValueError, match="read-only"):
            kv.read_blocks([(0, K, 0, bytes(kv.layout.block_bytes))])
        with pytest.raises(IndexError, match="block 8 out of range"):
            kv.write_blocks([(0, K, BLOCKS, block[3])])


def test_open_checks_expected_geometry_block_size_and_model(direct_dir):
    create(direct_dir).close()
    path = direct_dir / "kv.bin"
    other = KVGeometry(num_layers=3, num_kv_heads=4, head_dim=64, dtype="float32")
    with pytest.raises(StorageError, match=(r"kv.bin holds a different KV cache: num_kv_heads is 2 in the file but 4 "
                                            r"was expected; dtype is 'float16' in the file but 'float32' was expected")):
        KVBlockFile.open(path, geometry=other)
    with pytest.raises(StorageError, match="block_tokens is 16 in the file but 32 was expected"):
        KVBlockFile.open(path, block_tokens=32)
    with pytest.raises(StorageError, match="model_id is 'test-model' in the file but 'other' was expected"):
        KVBlockFile.open(path, model_id="other")
    with KVBlockFile.open(path, ALIGNED, TOKENS, "test-model") as kv:
        assert kv.layout.num_blocks == BLOCKS


def test_open_refuses_missing_foreign_truncated_and_newer_files(direct_dir):
    with pytest.raises(StorageError, match="nothing.kv: no such KV file"):
        KVBlockFile.open(direct_dir / "nothing.kv")
    foreign = direct_dir / "notes.txt"
    foreign.write_text("hello world\n" * 1000)
    with pytest.raises(StorageError, match="notes.txt is not a kvtier KV file"):
        KVBlockFile.open(foreign)
    kv = create(direct_dir)
    kv.close()
    os.truncate(kv.path, kv.layout.file_bytes - PAGE)
    with pytest.raises(StorageError, match=rf"kv.bin is truncated: {kv.layout.file_bytes - PAGE} bytes, but its "
                                           rf"header describes {kv.layout.file_bytes}"):
        KVBlockFile.open(kv.path)
    with open(kv.path, "r+b") as file:
        file.seek(8)
        file.write((7).to_bytes(4, "little"))
    with pytest.raises(StorageError, match="format version 7, this kvtier reads version 1"):
        KVBlockFile.open(kv.path)


def test_create_replaces_an_existing_file(direct_dir, rng):
    with create(direct_dir, model_id="old") as kv:
        kv.write_blocks(random_blocks(kv.layout, [(0, K, 0)], rng))
    with create(direct_dir, model_id="new") as kv:
        assert kv.model_id == "new"
    with KVBlockFile.open(direct_dir / "kv.bin", model_id="new") as kv:
        with pytest.raises(StorageError, match="never written"):
            kv.read_blocks(empty_like(random_blocks(kv.layout, [(0, K, 0)], rng)))


def test_create_needs_an_existing_writable_directory(tmp_path, read_only_dir):
    with pytest.raises(StorageError, match=rf"directory {tmp_path / 'missing'} does not exist"):
        create(tmp_path / "missing")
    with pytest.raises(StorageError, match=rf"directory {read_only_dir} is not writable"):
        create(read_only_dir)


def test_create_on_a_full_disk_fails_now_and_leaves_no_file(full_disk):
    big = KVGeometry(num_layers=8, num_kv_heads=2, head_dim=64, dtype="float16")  # 8 x 2 x 8 x 4 KiB = 512 KiB
    # of the disk's 1 MiB, the file's lock (and the pid in it) takes one page
    with pytest.raises(StorageError, match=rf"not enough space in {full_disk}: need 2.0MiB, have 1020.0KiB free"):
        KVBlockFile.create(full_disk / "kv.bin", big, TOKENS, 4 * BLOCKS, "m")
    assert os.listdir(full_disk) == []


def test_drop_page_cache_makes_reads_cold(direct_dir, rng, cached_pages):
    with create(direct_dir) as kv:
        kv.write_blocks(random_blocks(kv.layout, [(0, K, b) for b in range(BLOCKS)], rng))
        with open(kv.path, "rb") as file:
            file.read()  # a buffered reader pulls the file into the page cache
        assert cached_pages(kv.path) > 0
        kv.drop_page_cache()
        assert cached_pages(kv.path) == 0


def test_close_keeps_a_shared_engine_and_remove_deletes_the_file(direct_dir, engine, rng):
    kv = create(direct_dir, io=engine)
    kv.close()
    kv.close()  # closing twice is harmless
    again = create(direct_dir, io=engine)
    again.write_blocks(random_blocks(again.layout, [(0, K, 0)], rng))  # the engine still works
    again.remove()
    assert not os.path.exists(again.path) and not os.path.exists(again.path + ".lock")


def _paged_file(directory, rng):
    """A TWO_PAGES file with page checksums, K blocks 0..7 of layer 1 written; and those blocks' bytes, flat."""
    kv = KVBlockFile.create(directory / "kv.bin", TWO_PAGES, TOKENS, BLOCKS, "test-model", page_checksums=True)
    blocks = random_blocks(kv.layout, [(1, K, b) for b in range(BLOCKS)], rng)
    kv.write_blocks(blocks)
    return kv, np.concatenate([buf for *_, buf in blocks])


def test_page_reads_fill_only_the_chosen_pages_across_blocks(direct_dir, rng):
    kv, written = _paged_file(direct_dir, rng)
    with kv:
        page, per_block = kv.page_bytes, kv.layout.block_stride // kv.page_bytes
        out = aligned_buffer(written.nbytes)
        out[:] = 0
        # the last page of block 0 through the second of block 1 are one run; then two lone pages
        pages = np.array([per_block - 1, per_block, per_block + 1, 3 * per_block + 1, 6 * per_block])
        before = kv.io.stats.snapshot()
        kv.read_pages([(1, K, 0, pages, out)])
        moved = kv.io.stats.minus(before)
        assert moved.bytes_read == 5 * page and moved.read_calls == 3
        for number in range(written.nbytes // page):
            got, want = out[number * page : (number + 1) * page], written[number * page : (number + 1) * page]
            assert (got == want).all() if number in pages else not got.any(), f"page {number}"


def test_page_numbers_count_from_the_requested_block(direct_dir, rng):
    kv, written = _paged_file(direct_dir, rng)
    with kv:
        page, per_block = kv.page_bytes, kv.layout.block_stride // kv.page_bytes
        out = aligned_buffer(2 * page)
        kv.submit_read_pages([(1, K, 5, np.array([1]), out)]).result(timeout=30)
        overall = 5 * per_block + 1  # block 5's second page, counted from block 0
        assert (out[page:] == written[overall * page : (overall + 1) * page]).all()


def test_a_damaged_page_fails_its_check_and_its_neighbours_still_read(direct_dir, rng):
    kv, written = _paged_file(direct_dir, rng)
    with kv:
        page, per_block = kv.page_bytes, kv.layout.block_stride // kv.page_bytes
        damaged = 2 * per_block + 1  # second page of block 2
        fd = os.open(direct_dir / "kv.bin", os.O_WRONLY)
        os.pwrite(fd, bytes([written[damaged * page + 5] ^ 0x01]), kv.layout.offset(1, K, 2) + page + 5)
        os.fsync(fd)
        os.close(fd)
        out = aligned_buffer(written.nbytes)
        with pytest.raises(ChecksumError, match=r"checksum mismatch in data page \d+ .*layer 1 K from block 0"):
            kv.read_pages([(1, K, 0, np.array([damaged]), out)])
        kv.read_pages([(1, K, 0, np.array([damaged - 1, damaged + 1]), out)])
        kept = slice((damaged - 1) * page, damaged * page)
        assert (out[kept] == written[kept]).all()


def test_page_reads_refuse_unwritten_pages_files_without_page_crcs_and_bad_requests(direct_dir, rng):
    kv, _ = _paged_file(direct_dir, rng)
    with kv:
        page, per_block = kv.page_bytes, kv.layout.block_stride // kv.page_bytes
        with pytest.raises(ChecksumError, match="never written"):
            kv.read_pages([(1, V, 0, np.array([0]), aligned_buffer(PAGE))])
        with pytest.raises(ValueError, match="run past the last block"):
            kv.read_pages([(1, K, 7, np.array([per_block]), aligned_buffer((per_block + 1) * page))])
        with pytest.raises(ValueError, match="hold 3 pages"):
            kv.read_pages([(1, K, 0, np.array([2]), aligned_buffer(2 * page))])
    with KVBlockFile.open(direct_dir / "kv.bin") as reopened:
        with pytest.raises(StorageError, match="page reads need page checksums"):
            reopened.read_pages([(1, K, 0, np.array([0]), aligned_buffer(PAGE))])
    with pytest.raises(ConfigError, match="page checksums need blocks that fill whole pages"):
        KVBlockFile.create(direct_dir / "padded.bin", PADDED, TOKENS, BLOCKS, "test-model", page_checksums=True)
