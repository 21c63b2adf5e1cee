"""KV mode -> the transformers Cache that implements it (`KVConfig` -> a `kvtier.kv.contract.KVCache`).

`dense` (reference), `offload` (device -> host -> disk), `sparse` (HillInfer), and the HillInfer paper's
baselines `h2o`, `infinigen`, `leoam` (kvtier.baselines), all under the same budgets and storage layer.
It sits above every mode's package, so the modes themselves import only downward (kvtier.kv, storage).
"""

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from transformers.cache_utils import DynamicSlidingWindowLayer

from kvtier.baselines import BASELINES
from kvtier.baselines.selective_runtime import TierSetup
from kvtier.errors import ConfigError, StorageError
from kvtier.kv.budget import tier_capacity
from kvtier.kv.contract import KVCache
from kvtier.kv.dense import DenseCache
from kvtier.kv.model_geometry import full_attention_layers, model_geometry, text_config
from kvtier.kv.offload import OffloadCache, OffloadLayer, TieredStore
from kvtier.paths import cache_dir
from kvtier.sparse.cache import make_sparse_cache
from kvtier.sparse.cold.cold_image import IMAGE_DIR
from kvtier.sparse.settings import SparseSettings, parse_beta
from kvtier.storage import IOEngine, KVBlockFile
from kvtier.storage.stale_files import remove_abandoned_kv_files
from kvtier.docstore.entry import StoredKV
from kvtier.docstore.document_store import Match
from kvtier.units import parse_size

KV_MODES = ("dense", "offload", "sparse", *BASELINES)


@dataclass(frozen=True)
class KVConfig:
    """Where the KV cache may live. Sizes accept units (`64MiB`)."""

    kv: str = "dense"
    device_kv_budget: int | str = "64MiB"
    host_kv_budget: int | str = "256MiB"
    storage_dir: str | None = None  # default: ~/.cache/kvtier/kv
    block_tokens: int = 64  # HiFC's best block size (the HiFC paper, Fig. 6); 4 KiB-aligned for every packaged model
    io_threads: int = 8
    # sparse mode and baselines (kvtier.sparse.settings.SparseSettings documents each)
    alpha: float = 0.2
    score_bits: int = SparseSettings.score_bits
    beta: str | float = "auto"
    sink: int = 4
    recent: int = 64
    policy: str = "hit"  # sparse migration policy
    lookahead: bool = True  # sparse: prefetch the next layer's cold candidates with a predicted query

    def validated(self) -> "KVConfig":
        if self.kv not in KV_MODES:
            raise ConfigError(f"unknown KV mode {self.kv!r}; choose one of {', '.join(KV_MODES)}")
        if not 1 <= self.block_tokens <= 4096:
            raise ConfigError(f"block_tokens must be between 1 and 4096, got {self.block_tokens}")
        if self.io_threads < 1:
            raise ConfigError(f"io_threads must be at least 1, got {self.io_threads}")
        parse_size(self.device_kv_budget), parse_size(self.host_kv_budget)  # unparsable sizes fail before any model load
        self.sparse_settings()
        return self

    def sparse_settings(self) -> SparseSettings:
        """The sparse-mode settings these options describe (validated)."""
        return SparseSettings(alpha=self.alpha, score_bits=self.score_bits, beta=parse_beta(self.beta),
                              sink=self.sink, recent=self.recent, policy=self.policy,
                              lookahead=self.lookahead).validated()


def default_storage_dir() -> Path:
    return cache_dir() / "kv"


def make_cache(model, kv_config: KVConfig, max_tokens: int, batch_size: int = 1, model_id: str = "model",
               stored: Match | None = None) -> KVCache:
    """A fresh Cache for one generation of up to `max_tokens` tokens per sequence.

    `stored`: the prompt's prefix found in the document KV store, which a replay will feed to the cache; `sparse`
    uses the tiers stored with it in place, `offload` its K/V (raises CorruptEntry when kv.bin is gone or cut short).
    Tiered caches own files: call `.close()` or use the cache as a context manager.
    """
    kv_config = kv_config.validated()
    config = text_config(model)
    if stored is not None and kv_config.kv in ("sparse", "offload"):
        return _BUILDERS[kv_config.kv](model, config, kv_config, max_tokens, batch_size, model_id, stored)
    return _BUILDERS[kv_config.kv](model, config, kv_config, max_tokens, batch_size, model_id)


def _dense_cache(model, config, kv_config: KVConfig, max_tokens: int, batch_size: int, model_id: str) -> KVCache:
    return DenseCache(config=config)


def _sparse_cache(model, config, kv_config: KVConfig, max_tokens: int, batch_size: int, model_id: str,
                  stored: Match | None = None) -> KVCache:
    image_dir, image_tokens = (stored.entry.path / IMAGE_DIR, stored.tokens) if stored is not None else (None, 0)
    return make_sparse_cache(
        model, kv_config.sparse_settings(), max_tokens, batch_size, str(_storage_directory(kv_config.storage_dir)),
        parse_size(kv_config.device_kv_budget), parse_size(kv_config.host_kv_budget), full_attention_layers(config),
        kv_config.io_threads, image_dir, image_tokens,
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


_BUILDERS = {"dense": _dense_cache, "offload": _offload_cache, "sparse": _sparse_cache,
             **dict.fromkeys(BASELINES, _baseline_cache)}


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
