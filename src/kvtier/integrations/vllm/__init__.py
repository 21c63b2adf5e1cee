"""HiFC's flash log as a secondary offloading tier of vLLM (0.33): `tier.KvtierFlashTier`.

    identity.py     what a flash file's chunks depend on (model, dtype, hashing, layout)
    flash_file.py   the pre-allocated flash file: header page, 4 KiB-aligned slots, O_DIRECT, flock
    journal.py      the index on disk: append-only records with per-record crc32c, torn tail dropped
    chunk_index.py  key -> (slot, crc, seq) in memory, rebuilt by replaying the journal
    chunk_store.py  FlashChunkStore: append at the log head, reclaim the oldest segment, verified reads
    tier.py         KvtierFlashTier: vLLM's SecondaryTierManager contract on top of the store
    config.py       the secondary-tier entry that enables it; vLLM's offloading config for one KV group
    placement.py    where written bytes landed on the device (FIEMAP): the physical sequential share
    bench.py        kvtier's tier vs vLLM's fs tier through the same interface (`kvtier bench vllm-tier`)

Only tier.py, config.py and bench.py import vLLM (config and bench when called); install it with `pip install 'kvtier[vllm]'` (see docs/vllm.md).
"""
