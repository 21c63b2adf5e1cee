"""The sparse path (HillInfer): `--kv sparse`, token-sparse attention over KV tiered to host memory and flash.

Per full-attention layer and sequence, the sink and recent window stay on the device; the rest is split
between a hot pool in host DRAM (hot/), scored by the host, and a cold pool on flash with its quantized key
sketches (cold/), scored next to the data by the storage scorer process (scorer/). Each decode step and
layer scores both pools, selects the top alpha share, fetches the chosen cold tokens' K/V, attends window +
chosen in one exact softmax, and migrates tokens between the pools (layer.py; lookahead.py predicts the next
layer's query so the scorer reads its candidates ahead). docs/ARCHITECTURE.md has the files and the whys.

This face names what the rest of kvtier uses. Its names load on first use: `python -m
kvtier.sparse.scorer.process` imports this package first and must stay free of torch (it starts fast).
"""

from importlib import import_module

_FACE = {
    "SparseCache": "kvtier.sparse.cache",
    "make_sparse_cache": "kvtier.sparse.cache",
    "SparseSettings": "kvtier.sparse.settings",
    "parse_beta": "kvtier.sparse.settings",
    "SCORE_BITS": "kvtier.sparse.cold.sketch",
    "decoding": "kvtier.sparse.threads",
    "machine_threads": "kvtier.sparse.threads",
    "thread_settings": "kvtier.sparse.threads",
    "describe_threads": "kvtier.sparse.threads",
}
__all__ = list(_FACE)


def __getattr__(name: str):
    if name not in _FACE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_FACE[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value
