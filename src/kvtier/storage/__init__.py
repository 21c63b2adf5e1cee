"""Storage layer: KV block geometry, aligned buffers, direct file I/O, checksummed block files.

Knows nothing of transformers or torch; buffers are anything with contiguous
bytes (numpy arrays, bytearrays, CPU tensors viewed as uint8).

    geometry.py     KVGeometry (per-token KV size), BlockLayout (block -> 4 KiB-aligned file offset)
    aligned.py      page-aligned buffers for O_DIRECT, byte views of caller buffers
    checksum.py     crc32c of blocks, the per-block checksum table, in-memory per-page crcs
    crc32c_units.c  the crc32c of many pages (read units) in one compiled call
    direct_file.py  O_DIRECT open with buffered fallback, its read unit, page-cache eviction, fsynced new files
    sealed_json.py  small metadata files sealed with their own crc32c
    io_engine.py    thread pool of preadv/pwritev over runs of adjacent buffers; scattered reads in one batch
    kernel_aio.py   Linux kernel AIO (io_submit/io_getevents) through ctypes, for those batches
    header.py       page 0 of a block file (format version, layout, model id)
    block_file.py   KVBlockFile: create/open/validate, coalesced checksummed block I/O, page reads
    pages.py        which pages (read units) hold chosen fixed-size records (tokens), short gaps bridged
    flash_log.py    slot allocators of the flash cache file: HiFC's append-only log and the naive reuse baseline
    stale_files.py  KV files left in a storage dir by killed runs, found and removed
    file_lock.py    one writer per file: a flock on `<file>.lock`, which names the holder's pid
"""

from kvtier.storage.aligned import aligned_buffer, byte_view, is_aligned
from kvtier.storage.block_file import KVBlockFile
from kvtier.storage.checksum import checksum
from kvtier.storage.direct_file import direct_read_unit, drop_page_cache, fsync_directory, open_direct, write_new_file
from kvtier.storage.geometry import DTYPE_SIZES, PAGE, SECTOR, BlockLayout, K, KVGeometry, V, round_up
from kvtier.storage.header import FORMAT_VERSION, MAGIC
from kvtier.storage.io_engine import IOEngine, IOStats

__all__ = [
    "DTYPE_SIZES", "FORMAT_VERSION", "MAGIC", "PAGE", "SECTOR", "K", "V",
    "BlockLayout", "IOEngine", "IOStats", "KVBlockFile", "KVGeometry",
    "aligned_buffer", "byte_view", "checksum", "direct_read_unit", "drop_page_cache", "fsync_directory", "is_aligned",
    "open_direct", "round_up", "write_new_file",
]
