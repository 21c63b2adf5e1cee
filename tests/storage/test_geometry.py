from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import ConfigError
from kvtier.storage.geometry import DTYPE_SIZES, PAGE, BlockLayout, K, KVGeometry, V, round_up

SMOLLM2 = KVGeometry(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float16")


def test_round_up():
    assert [round_up(n, 4096) for n in (0, 1, 4096, 4097)] == [0, 4096, 4096, 8192]


def test_geometry_sizes():
    assert SMOLLM2.itemsize == 2
    assert SMOLLM2.token_bytes_per_layer == 3 * 64 * 2
    assert SMOLLM2.token_bytes == 30 * 2 * 384


def test_geometry_accepts_torch_dtype_names():
    assert KVGeometry(1, 1, 8, "torch.bfloat16").dtype == "bfloat16"


@pytest.mark.parametrize("kwargs, message", [
    ({"num_layers": 0}, "num_layers must be a positive integer"),
    ({"num_kv_heads": 2.5}, "num_kv_heads must be a positive integer"),
    ({"head_dim": True}, "head_dim must be a positive integer"),
    ({"dtype": "int8"}, "unsupported dtype 'int8'"),
])
def test_geometry_rejects_bad_values(kwargs, message):
    values = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "dtype": "float32", **kwargs}
    with pytest.raises(ConfigError, match=message):
        KVGeometry(**values)


def test_from_config_reads_llama_style_config():
    config = SimpleNamespace(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                             hidden_size=576, head_dim=None)
    assert KVGeometry.from_config(config, "float16") == SMOLLM2


def test_from_config_prefers_explicit_head_dim_and_falls_back_to_attention_heads():
    config = SimpleNamespace(num_hidden_layers=4, num_attention_heads=4, hidden_size=640, head_dim=256)
    assert KVGeometry.from_config(config, "float32") == KVGeometry(4, 4, 256, "float32")


def test_from_config_uses_text_config_of_multimodal_models():
    text = SimpleNamespace(num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                           hidden_size=640, head_dim=256)
    assert KVGeometry.from_config(SimpleNamespace(text_config=text), "bfloat16") == KVGeometry(18, 1, 256, "bfloat16")


def test_from_config_names_missing_field():
    with pytest.raises(ConfigError, match="has no num_hidden_layers"):
        KVGeometry.from_config(SimpleNamespace(num_attention_heads=4, hidden_size=64), "float32")


def test_geometry_dict_round_trip():
    assert SMOLLM2.to_dict() == {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "dtype": "float16"}
    assert KVGeometry.from_dict(SMOLLM2.to_dict()) == SMOLLM2


def test_layout_follows_hifc_formula():
    geometry = KVGeometry(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16")
    layout = BlockLayout(geometry, block_tokens=32, num_blocks=10, data_offset=2 * PAGE)
    assert layout.block_bytes == 2 * 2 * 64 * 32 == layout.block_stride
    assert layout.layer_bytes == 2 * 10 * 8192
    assert layout.offset(0, K, 0) == 2 * PAGE
    assert layout.offset(3, V, 7) == 2 * PAGE + 3 * layout.layer_bytes + 10 * 8192 + 7 * 8192
    assert layout.file_bytes == 2 * PAGE + 4 * layout.layer_bytes


def test_layout_pads_blocks_to_pages():
    layout = BlockLayout(SMOLLM2, block_tokens=16, num_blocks=4)
    assert layout.block_bytes == 6144
    assert layout.block_stride == 8192
    assert layout.offset(0, K, 1) == 8192


def test_layout_slots_are_adjacent_across_kind_and_layer_boundaries():
    layout = BlockLayout(SMOLLM2, block_tokens=64, num_blocks=5)
    assert layout.slot(0, V, 0) == layout.slot(0, K, 4) + 1
    assert layout.slot(1, K, 0) == layout.slot(0, V, 4) + 1
    assert layout.num_slots == 30 * 2 * 5


@pytest.mark.parametrize("index, message", [
    ((30, K, 0), "layer 30 out of range"),
    ((0, 2, 0), "kind 2 out of range"),
    ((0, V, 5), "block 5 out of range"),
    ((0, K, -1), "block -1 out of range"),
])
def test_layout_bounds_checks(index, message):
    with pytest.raises(IndexError, match=message):
        BlockLayout(SMOLLM2, block_tokens=64, num_blocks=5).offset(*index)


@pytest.mark.parametrize("kwargs, message", [
    ({"block_tokens": 0}, "block_tokens"),
    ({"num_blocks": -1}, "num_blocks"),
    ({"data_offset": 100}, "data_offset must be a non-negative multiple of 4096"),
])
def test_layout_rejects_bad_values(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        BlockLayout(SMOLLM2, **{"block_tokens": 16, "num_blocks": 4, **kwargs})


layouts = st.builds(
    BlockLayout,
    geometry=st.builds(KVGeometry, num_layers=st.integers(1, 4), num_kv_heads=st.integers(1, 8),
                       head_dim=st.integers(1, 160), dtype=st.sampled_from(sorted(DTYPE_SIZES))),
    block_tokens=st.integers(1, 96),
    num_blocks=st.integers(1, 6),
    data_offset=st.integers(0, 3).map(lambda pages: pages * PAGE),
)


@settings(max_examples=200, deadline=None)
@given(layouts)
def test_every_block_is_aligned_disjoint_and_inside_the_file(layout):
    offsets = sorted(layout.offset(layer, kind, block)
                     for layer in range(layout.geometry.num_layers) for kind in (K, V)
                     for block in range(layout.num_blocks))
    assert len(offsets) == layout.num_slots
    assert all(offset % PAGE == 0 for offset in offsets)
    assert offsets[0] >= layout.data_offset
    assert all(later - earlier >= layout.block_bytes for earlier, later in zip(offsets, offsets[1:]))
    assert offsets[-1] + layout.block_bytes <= layout.file_bytes


def test_payload_span_starts_on_a_page_and_covers_one_payload():
    layout = BlockLayout(KVGeometry(2, 3, 40, "float32"), block_tokens=16, num_blocks=4)  # 7680 B payload, 8 KiB stride
    span = layout.payload_span(3)
    assert span.start == 3 * layout.block_stride and span.start % PAGE == 0
    assert span.stop - span.start == layout.block_bytes < layout.block_stride
