"""`--kv dense`, the reference: transformers' DynamicCache (every token on the device) under the cache contract."""

from transformers import DynamicCache

from kvtier.kv.contract import KVCache
from kvtier.storage import IOStats


class DenseCache(DynamicCache, KVCache):
    """All K/V on the compute device; no files, so nothing to read, write or delete."""

    def io_stats(self) -> IOStats:
        return IOStats()

    def close(self) -> None:
        pass
