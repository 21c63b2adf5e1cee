"""Shape of a model's KV cache and where each KV block lives in a block file.

`KVGeometry` is the per-token size of the KV cache (layers, KV heads, head dim,
dtype). `BlockLayout` maps (layer, K|V, block) to a byte offset, following the
HiFC appendix: each layer holds all K blocks, then all V blocks, so that a
layer's K (or V) is one contiguous region and consecutive blocks coalesce into
one sequential I/O. Every block starts on a 4 KiB boundary, the granularity of
SSD logical blocks and of O_DIRECT.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvtier.errors import ConfigError

PAGE = 4096
# The smallest logical block of Linux block devices: O_DIRECT accepts reads of this size and alignment where the
# device's logical block is 512 bytes (direct_file.direct_read_unit finds out); files still lay regions on PAGEs.
SECTOR = 512
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}
K, V = 0, 1
KIND_NAMES = ("K", "V")


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= n."""
    return -(-n // multiple) * multiple


def _require_positive_int(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{owner}: {name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class KVGeometry:
    """Size of the KV cache of one model: `num_layers` x (K, V) x heads x head_dim of `dtype`."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            _require_positive_int("KV geometry", name, getattr(self, name))
        # Accept torch dtypes too (str(torch.float16) == "torch.float16") without importing torch.
        name = str(self.dtype).removeprefix("torch.")
        if name not in DTYPE_SIZES:
            raise ConfigError(f"KV geometry: unsupported dtype {self.dtype!r}; use one of {', '.join(DTYPE_SIZES)}")
        object.__setattr__(self, "dtype", name)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def token_bytes_per_layer(self) -> int:
        """Bytes of K (or of V) for one token in one layer."""
        return self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def token_bytes(self) -> int:
        """Bytes of K and V for one token over all layers."""
        return self.num_layers * 2 * self.token_bytes_per_layer

    @classmethod
    def from_config(cls, config: Any, dtype: str) -> KVGeometry:
        """Geometry of a Hugging Face model config (duck-typed; multimodal configs use their `text_config`)."""
        text_config = getattr(config, "text_config", None)
        if text_config is not None:
            config = text_config
        num_layers = _config_value(config, "num_hidden_layers")
        num_kv_heads = getattr(config, "num_key_value_heads", None) or _config_value(config, "num_attention_heads")
        head_dim = getattr(config, "head_dim", None)
        if head_dim is None:
            head_dim = _config_value(config, "hidden_size") // _config_value(config, "num_attention_heads")
        return cls(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVGeometry:
        return cls(**{name: data[name] for name in ("num_layers", "num_kv_heads", "head_dim", "dtype")})


def _config_value(config: Any, name: str) -> Any:
    value = getattr(config, name, None)
    if value is None:
        raise ConfigError(f"model config {type(config).__name__} has no {name}: cannot size its KV cache")
    return value


@dataclass(frozen=True)
class BlockLayout:
    """Byte offsets of K/V blocks of `block_tokens` tokens, `num_blocks` per layer and kind, from `data_offset`."""

    geometry: KVGeometry
    block_tokens: int
    num_blocks: int
    data_offset: int = 0

    def __post_init__(self) -> None:
        _require_positive_int("block layout", "block_tokens", self.block_tokens)
        _require_positive_int("block layout", "num_blocks", self.num_blocks)
        if isinstance(self.data_offset, bool) or not isinstance(self.data_offset, int) or self.data_offset < 0 \
                or self.data_offset % PAGE:
            raise ConfigError(f"block layout: data_offset must be a non-negative multiple of {PAGE}, "
                              f"got {self.data_offset!r}")

    @property
    def block_bytes(self) -> int:
        """H x S x D x T: the payload of one K (or V) block."""
        return self.geometry.token_bytes_per_layer * self.block_tokens

    @property
    def block_stride(self) -> int:
        """Distance between consecutive blocks: the payload padded so every block starts on a page."""
        return round_up(self.block_bytes, PAGE)

    @property
    def fills_pages(self) -> bool:
        """Whether a block is a whole number of pages (no padding): single pages can then be read."""
        return self.block_bytes == self.block_stride

    def payload_span(self, index: int) -> slice:
        """Bytes of block (or swap slot) `index` in a buffer of blocks laid `block_stride` apart."""
        start = index * self.block_stride
        return slice(start, start + self.block_bytes)

    @property
    def layer_bytes(self) -> int:
        return 2 * self.num_blocks * self.block_stride

    @property
    def data_bytes(self) -> int:
        return self.geometry.num_layers * self.layer_bytes

    @property
    def file_bytes(self) -> int:
        """Size of a file holding this layout: everything before the data region plus the data region."""
        return self.data_offset + self.data_bytes

    @property
    def num_slots(self) -> int:
        """Number of blocks in the data region over all layers and both kinds."""
        return self.geometry.num_layers * 2 * self.num_blocks

    def slot(self, layer: int, kind: int, block: int) -> int:
        """Position of the block in the data region, counted in blocks.

        Layers follow each other, and V follows K within a layer, so blocks with consecutive
        slots are adjacent on disk even across a K/V or layer boundary.
        """
        self.check_index(layer, kind, block)
        return (layer * 2 + kind) * self.num_blocks + block

    def offset(self, layer: int, kind: int, block: int) -> int:
        """File offset of block `block` of K (kind 0) or V (kind 1) in `layer`.

        Equal to data_offset + layer * layer_bytes + kind * num_blocks * block_stride + block * block_stride.
        """
        return self.data_offset + self.slot(layer, kind, block) * self.block_stride

    def check_index(self, layer: int, kind: int, block: int) -> None:
        """Raise IndexError for a (layer, kind, block) outside this layout."""
        if not 0 <= layer < self.geometry.num_layers:
            raise IndexError(f"layer {layer} out of range: the layout has {self.geometry.num_layers} layers")
        if kind not in (K, V):
            raise IndexError(f"kind {kind} out of range: use K (0) or V (1)")
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} out of range: the layout has {self.num_blocks} blocks per layer")
