"""An entry's records: written from a prefill's updates, read back exactly, and never used when damaged."""

import errno

import pytest
import torch

from kvtier.errors import StorageError
from kvtier.storage import IOEngine
from kvtier.docstore.entry import KV, EntryWriter, read_layers
from kvtier.docstore.meta import CorruptEntry, read_meta
from store_entries import BLOCK, HEAD_DIM, HEADS, LAYERS, block_names, new_meta, prefill_updates

def write_entry(directory, tokens=5 * BLOCK + 7, chunk=45, dtype=torch.float32, dtype_name="float32"):
    updates, whole = prefill_updates(tokens, chunk, dtype)
    writer = EntryWriter(directory, new_meta(block_names("key", tokens // BLOCK), dtype_name))
    for layer, keys, values in updates:
        writer.add(layer, keys, values)
    writer.finish()
    return writer, whole


def read_all(directory, blocks):
    with IOEngine(2) as io:
        return list(read_layers(directory, read_meta(directory), blocks, io))


@pytest.mark.parametrize("dtype, name", [(torch.float32, "float32"), (torch.bfloat16, "bfloat16")])
@pytest.mark.parametrize("chunk", [45, 3 * BLOCK + 8])  # updates shorter than a block, or holding several
def test_any_prefix_of_whole_blocks_reads_back_exactly(tmp_path, dtype, name, chunk):
    writer, whole = write_entry(tmp_path / "entry", chunk=chunk, dtype=dtype, dtype_name=name)
    assert writer.blocks_written == 5 and read_meta(tmp_path / "entry").blocks == block_names("key", 5)
    for blocks in (1, 3, 5):
        for layer, keys, values in read_all(tmp_path / "entry", blocks):
            assert keys.dtype == dtype and keys.shape == (1, HEADS, blocks * BLOCK, HEAD_DIM)
            assert torch.equal(keys, whole[layer][0][:, :, : blocks * BLOCK])
            assert torch.equal(values, whole[layer][1][:, :, : blocks * BLOCK])


def test_a_flipped_byte_in_a_record_is_caught_naming_the_record(tmp_path):
    write_entry(tmp_path / "entry")
    meta = read_meta(tmp_path / "entry")
    with open(tmp_path / "entry" / KV, "r+b") as file:
        file.seek(meta.region_offset(1, 1, 1) + 2 * meta.record_bytes(1) + 5)  # layer 1, V, head 1, block 2
        byte = file.read(1)
        file.seek(-1, 1)
        file.write(bytes([byte[0] ^ 0x40]))
    read_all(tmp_path / "entry", 2)  # the blocks before it are intact
    with pytest.raises(CorruptEntry, match="block 2 layer 1 V head 1 fails its checksum"):
        read_all(tmp_path / "entry", 3)


def test_a_truncated_file_is_caught_before_reading(tmp_path):
    write_entry(tmp_path / "entry")
    meta = read_meta(tmp_path / "entry")
    with open(tmp_path / "entry" / KV, "r+b") as file:
        file.truncate(meta.nbytes - 4096)
    with pytest.raises(CorruptEntry, match="truncated"):
        read_all(tmp_path / "entry", 1)


def test_a_damaged_meta_file_is_a_damaged_entry(tmp_path):
    write_entry(tmp_path / "entry")
    path = tmp_path / "entry" / "meta.json"
    text = path.read_text()
    path.write_text(text.replace('\\"dtype\\": \\"float32\\"', '\\"dtype\\": \\"float16\\"'))
    assert path.read_text() != text
    with pytest.raises(CorruptEntry, match="fails its checksum"):
        read_meta(tmp_path / "entry")
    path.write_text(text[: len(text) // 2])
    with pytest.raises(CorruptEntry, match="unreadable"):
        read_meta(tmp_path / "entry")


def test_a_full_disk_marks_the_writer_failed_instead_of_raising(tmp_path, monkeypatch):
    updates, _ = prefill_updates(3 * BLOCK, 40)
    writer = EntryWriter(tmp_path / "entry", new_meta(block_names("key", 3)))

    def no_space(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("kvtier.docstore.entry.os.pwrite", no_space)
    for layer, keys, values in updates:
        writer.add(layer, keys, values)  # the prefill it rides on goes on
    assert writer.failure is not None and writer.failure.errno == errno.ENOSPC
    writer.abandon()


def test_a_layout_with_records_off_page_boundaries_is_refused(tmp_path):
    meta = new_meta(block_names("key", 1))
    meta.layers = [[HEADS, 24]] * LAYERS  # 64 tokens x 24 x 4 bytes: not whole pages
    with pytest.raises(StorageError, match="not a whole number of 4 KiB pages"):
        EntryWriter(tmp_path / "entry", meta)
