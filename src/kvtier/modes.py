"""KV mode -> the transformers Cache that implements it (`KVConfig` -> a `kvtier.kv.contract.KVCache`).

`dense` (reference), `offload` (device -> host -> disk), `sparse` (HillInfer), the HillInfer paper's baselines
`h2o`, `infinigen`, `leoam`, and `quest` (kvtier.baselines), all under the same budgets and storage layer.
It sits above every mode's package, so the modes themselves import only downward (kvtier.kv, storage).
"""

import os
import uuid
from pathlib import Path

from transformers.cache_utils import DynamicSlidingWindowLayer

from kvtier.baselines import BASELINES
from kvtier.baselines.selective_runtime import TierSetup
from kvtier.errors import StorageError
from kvtier.kv.budget import tier_capacity
from kvtier.kv.contract import KVCache
from kvtier.kv.dense import DenseCache
from kvtier.kv.model_geometry import full_attention_layers, model_geometry, text_config
from kvtier.kv.offload import OffloadCache, OffloadLayer, TieredStore
from kvtier.kv_config import KV_MODES, KVConfig, default_storage_dir  # re-exported with the builders
from kvtier.sparse import make_sparse_cache
from kvtier.storage import IOEngine, KVBlockFile
from kvtier.storage.stale_files import remove_abandoned_kv_files
from kvtier.docstore.entry import StoredKV
from kvtier.docstore.document_store import Match
from kvtier.units import parse_size


def make_cache(model, kv_config: KVConfig, max_tokens: int, batch_size: int = 1, model_id: str = "model",
               stored: Match | None = None, route_attention: bool = True) -> KVCache:
    """A fresh Cache for one generation of up to `max_tokens` tokens per sequence.

    `stored`: the prompt's prefix found in the document KV store, which a replay will feed to the cache; `sparse`
    uses the tiers stored with it in place, `offload` its K/V (raises CorruptEntry when kv.bin is gone or cut short).
    Tiered caches own files: call `.close()` or use the cache as a context manager. `route_attention` False: the
    caller routes the model's attention to the cache (the serving engine; sparse mode only).
    """
    kv_config = kv_config.validated()
    config = text_config(model)
    if kv_config.kv == "sparse":
        return _sparse_cache(model, config, kv_config, max_tokens, batch_size, stored, route_attention)
    if stored is not None and kv_config.kv == "offload":
        return _offload_cache(model, config, kv_config, max_tokens, batch_size, model_id, stored)
    return _BUILDERS[kv_config.kv](model, config, kv_config, max_tokens, batch_size, model_id)


def _dense_cache(model, config, kv_config: KVConfig, max_tokens: int, batch_size: int, model_id: str) -> KVCache:
    return DenseCache(config=config)


def _sparse_cache(model, config, kv_config: KVConfig, max_tokens: int, batch_size: int, stored: Match | None,
                  route_attention: bool) -> KVCache:
    entry_dir, image_tokens = (stored.entry.path, stored.tokens) if stored is not None else (None, 0)
    return make_sparse_cache(
        model, kv_config.sparse_settings(), max_tokens, batch_size, str(_storage_directory(kv_config.storage_dir)),
        parse_size(kv_config.device_kv_budget), parse_size(kv_config.host_kv_budget), full_attention_layers(config),
        kv_config.io_threads, entry_dir, image_tokens, route_attention,
    )


def _baseline_cache(model, config, kv_config: KVConfig, max_tokens: int, batch_size: int, model_id: str) -> KVCache:
    setup = TierSetup(
        kv_config.sparse_settings(), max_tokens, batch_size, _storage_directory(kv_config.storage_dir),
        parse_size(kv_config.device_kv_budget), parse_size(kv_config.host_kv_budget),
        tuple(full_attention_layers(config)), kv_config.block_tokens, kv_config.io_threads, model_id,
    )
    return BASELINES[kv_config.kv](model, setup)


def _offload_cache(model, config, kv_config: KVConfig, max_tokens: int, batch_size: int, model_id: str,
                   stored: Match | None = None) -> OffloadCache:
    tiered = full_attention_layers(config)
    geometry = model_geometry(model, tiered)
    capacity = tier_capacity(
        parse_size(kv_config.device_kv_budget),
        parse_size(kv_config.host_kv_budget),
        geometry.token_bytes,
        kv_config.block_tokens,
        batch_size,
    )
    blocks_per_seq = -(-max_tokens // kv_config.block_tokens)
    file = KVBlockFile.create(
        _kv_file_path(kv_config.storage_dir),
        geometry,
        kv_config.block_tokens,
        blocks_per_seq * batch_size,
        model_id,
        io=IOEngine(kv_config.io_threads),
    )
    try:
        in_place = stored is not None and batch_size == 1  # an entry holds one sequence
        base = StoredKV(stored.entry.path, stored.entry.meta, stored.tokens) if in_place else None
    except BaseException:
        file.remove()
        raise
    store = TieredStore(file, {layer: i for i, layer in enumerate(tiered)}, batch_size, base)
    layers = []
    for i in range(config.num_hidden_layers):
        if i in store.tier_of_layer:
            following = tiered[(tiered.index(i) + 1) % len(tiered)]
            layers.append(OffloadLayer(i, store, capacity, following))
        else:
            layers.append(DynamicSlidingWindowLayer(sliding_window=config.sliding_window))
    return OffloadCache(layers, store)


_BUILDERS = {"dense": _dense_cache, "offload": _offload_cache, **dict.fromkeys(BASELINES, _baseline_cache)}


def _kv_file_path(storage_dir: str | None) -> Path:
    return _storage_directory(storage_dir) / f"kv-{os.getpid()}-{uuid.uuid4().hex[:8]}.kvt"


def _storage_directory(storage_dir: str | None) -> Path:
    """The directory for KV files, checked to be writable. The default is created with its parents; a given one
    is created when its parent exists (as Hugging Face cache dirs and LMCache disk paths are)."""
    directory = Path(storage_dir) if storage_dir else default_storage_dir()
    if storage_dir is None:
        directory.mkdir(parents=True, exist_ok=True)
    elif not directory.exists() and directory.parent.is_dir():
        directory.mkdir(exist_ok=True)
    if not directory.is_dir():
        raise StorageError(f"storage dir {directory} does not exist or is not a directory")
    if not os.access(directory, os.W_OK):
        raise StorageError(f"storage dir {directory} is not writable")
    remove_abandoned_kv_files(directory)
    return directory
