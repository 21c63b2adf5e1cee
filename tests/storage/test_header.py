import json
import struct

import pytest

from kvtier.errors import ChecksumError, StorageError
from kvtier.storage.geometry import PAGE, BlockLayout, KVGeometry
from kvtier.storage.header import FORMAT_VERSION, MAGIC, FileHeader, decode_header, encode_header

HEADER = FileHeader(BlockLayout(KVGeometry(24, 2, 64, "float32"), block_tokens=64, num_blocks=100,
                                data_offset=3 * PAGE), model_id="qwen2.5-0.5b")


def test_header_round_trip():
    page = encode_header(HEADER)
    assert len(page) == PAGE
    assert page.startswith(MAGIC)
    assert struct.unpack_from("<I", page, len(MAGIC))[0] == FORMAT_VERSION == 1
    assert decode_header(page, "f.kv") == HEADER


def test_header_json_is_readable():
    length = struct.unpack_from("<I", encode_header(HEADER), 12)[0]
    body = json.loads(encode_header(HEADER)[20:20 + length])
    assert body["model_id"] == "qwen2.5-0.5b" and body["geometry"]["num_kv_heads"] == 2


def test_foreign_data_is_not_a_kvtier_file():
    with pytest.raises(StorageError, match=r"notes.txt is not a kvtier KV file \(it starts with b'hello wo'\)"):
        decode_header(b"hello world", "notes.txt")
    with pytest.raises(StorageError, match="is not a kvtier KV file"):
        decode_header(b"", "empty.kv")


def test_other_format_version_is_refused():
    page = bytearray(encode_header(HEADER))
    struct.pack_into("<I", page, len(MAGIC), 2)
    with pytest.raises(StorageError, match="f.kv has KV file format version 2, this kvtier reads version 1"):
        decode_header(bytes(page), "f.kv")


def test_corrupt_header_is_detected():
    page = bytearray(encode_header(HEADER))
    page[40] ^= 0x01
    with pytest.raises(ChecksumError, match="f.kv: the file header is corrupt"):
        decode_header(bytes(page), "f.kv")


def test_truncated_header_is_detected():
    with pytest.raises(StorageError, match=r"f.kv: truncated header \(60 bytes\)"):
        decode_header(encode_header(HEADER)[:60], "f.kv")


def test_model_id_too_long_for_the_header_page():
    header = FileHeader(HEADER.layout, model_id="m" * PAGE)
    with pytest.raises(StorageError, match="use a shorter model id"):
        encode_header(header)
