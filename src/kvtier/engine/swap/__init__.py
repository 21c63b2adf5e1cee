"""Swap space for preempted paged sequences: where a victim's device blocks go and come back from.

    backend.py          the interface: asynchronous swap-out, synchronous swap-in, slots from an allocator
    flash.py            HiFC's flash cache: O_DIRECT pwritev/preadv, the append-only log, a crc32c per block
    gds.py              the same file written from GPU memory through kvikio (GPUDirect Storage)
    device_checksum.py  block checksums computed where the blocks live (on the GPU for gds.py)
    dram.py             the host-DRAM baseline
"""
