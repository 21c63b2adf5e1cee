"""What a stored prefix is keyed on: everything that changes its bytes, and its tokens chained per block.

Two prompts share a block only if every token up to and including it is the
same and the K/V were computed by the same weights, dtype, device kind and
store layout. So the key of block i hashes the key of block i - 1 with the
block's token ids, starting from the identity's digest (as vLLM's prefix
caching chains its block hashes): a different model never matches, and a
prompt's longest stored prefix is the longest run of equal block keys.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvtier.kv.model_geometry import model_geometry
from kvtier.models.install import file_sha256
from kvtier.storage import PAGE

FORMAT_VERSION = 1  # of the entry layout (entry.py); bumping it makes every older entry a non-match
MIN_BLOCK_TOKENS = 16  # a question reuses its document up to the block it starts in: the rest is prefilled again
DOCUMENT_TOKENS = 256  # the leading tokens that tell a user a store holds this document for another model


@dataclass(frozen=True)
class StoreIdentity:
    """What the stored bytes depend on besides the tokens."""

    model_id: str  # name@gguf-sha256, or hf:<directory>
    weights: str  # digest of the weight files (the GGUF's sha256 is already in model_id)
    dtype: str
    device: str  # cpu, cuda: kernels differ in rounding
    block_tokens: int = MIN_BLOCK_TOKENS
    format_version: int = FORMAT_VERSION

    def digest(self) -> str:
        return _sha256(json.dumps(asdict(self), sort_keys=True).encode())


def identity_of(llm) -> StoreIdentity:
    """The identity of a loaded model's KV."""
    geometry = model_geometry(llm.model)
    return StoreIdentity(llm.model_id, _weights_digest(llm), str(llm.dtype).removeprefix("torch."),
                         llm.model.device.type, block_tokens_for(geometry.head_dim, geometry.itemsize))


def block_tokens_for(head_dim: int, item_bytes: int) -> int:
    """Tokens per stored block: the fewest (a power of two, at least MIN_BLOCK_TOKENS) that make one head's K or V
    of a block whole 4 KiB pages, so that O_DIRECT reads land in place (entry.py)."""
    tokens = MIN_BLOCK_TOKENS
    while tokens < PAGE and tokens * head_dim * item_bytes % PAGE:
        tokens *= 2
    return tokens


def block_keys(identity_digest: str, ids: Sequence[int], block_tokens: int) -> list[str]:
    """The chained key of every whole block of `ids`."""
    tokens = np.asarray(ids, dtype=np.int64)
    keys, previous = [], identity_digest
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        previous = _sha256(previous.encode() + tokens[start : start + block_tokens].tobytes())
        keys.append(previous)
    return keys


def document_key(ids: Sequence[int]) -> str:
    """The leading tokens alone: tells a user that a store holds this document for another model."""
    return _sha256(np.asarray(ids[:DOCUMENT_TOKENS], dtype=np.int64).tobytes())


def _weights_digest(llm) -> str:
    if not llm.model_id.startswith("hf:"):
        return llm.model_id  # registry and .gguf models: the id carries the file's sha256
    directory = Path(llm.model_id.removeprefix("hf:"))
    files = sorted(path for pattern in ("*.safetensors", "*.bin") for path in directory.glob(pattern))
    return _sha256("".join(f"{path.name}:{file_sha256(path)};" for path in files).encode())


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
