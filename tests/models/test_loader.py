import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvtier.errors import ConfigError, ModelError
from kvtier.models import loader
from kvtier.models.install import file_sha256
from kvtier.models.loader import converted_path, load_model
from kvtier.paths import converted_dir


def test_hf_directory_loads_its_saved_weights(tiny_hf_dir):
    llm = load_model(str(tiny_hf_dir))
    saved = load_file(tiny_hf_dir / "model.safetensors")
    loaded = llm.model.model.layers[1].self_attn.k_proj.weight
    assert torch.equal(loaded, saved["model.layers.1.self_attn.k_proj.weight"])
    assert llm.name == tiny_hf_dir.name
    assert llm.model_id == f"hf:{tiny_hf_dir.resolve()}"
    assert (llm.config.num_hidden_layers, llm.config.num_key_value_heads) == (2, 2)
    assert llm.context_length == 512
    assert llm.has_chat_template is False
    assert llm.dtype == torch.float32
    assert llm.model.training is False
    assert llm.config._attn_implementation == "sdpa"
    assert llm.tokenizer("the sea")["input_ids"] == [2, 7]


def test_dtype_and_attention_are_applied(tiny_hf_dir):
    llm = load_model(str(tiny_hf_dir), dtype="bfloat16", attn_implementation="eager")
    assert llm.dtype == torch.bfloat16
    assert {parameter.dtype for parameter in llm.model.parameters()} == {torch.bfloat16}
    assert llm.config._attn_implementation == "eager"


def test_bad_dtype_and_device_are_config_errors(tiny_hf_dir):
    with pytest.raises(ConfigError, match="unsupported dtype 'float8': use one of float32, float16, bfloat16"):
        load_model(str(tiny_hf_dir), dtype="float8")
    with pytest.raises(ConfigError, match="unknown device 'gpu0'"):
        load_model(str(tiny_hf_dir), device="gpu0")


def test_unknown_name_and_missing_path_say_what_is_accepted(tmp_path):
    with pytest.raises(ModelError, match="no model named .*nope.* use one of gemma3-270m, qwen2.5-0.5b, smollm2-135m"):
        load_model(str(tmp_path / "nope"))


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelError, match="has no config.json"):
        load_model(str(tmp_path))


def test_file_that_is_not_gguf_is_rejected(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")
    with pytest.raises(ModelError, match="weights.bin is neither a .gguf file nor a model directory"):
        load_model(str(path))


def _copy_of(directory, destination):
    destination.mkdir()
    for file in directory.iterdir():
        (destination / file.name).write_bytes(file.read_bytes())
    return destination


def test_corrupt_weights_are_a_one_line_model_error(tiny_hf_dir, tmp_path):
    broken = _copy_of(tiny_hf_dir, tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with pytest.raises(ModelError, match=f"cannot load {broken}") as info:
        load_model(str(broken))
    assert "\n" not in str(info.value)


def test_missing_weight_tensors_are_an_error_not_random_init(tiny_hf_dir, tmp_path):
    partial = _copy_of(tiny_hf_dir, tmp_path / "partial")
    tensors = load_file(partial / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, partial / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match="1 weight tensors missing .*model.layers.0.mlp.up_proj.weight"):
        load_model(str(partial))


def test_gguf_is_converted_once_then_loaded_from_safetensors(tiny_gguf, cache, monkeypatch):
    sha256 = file_sha256(tiny_gguf)
    killed_writer = subprocess.Popen([sys.executable, "-c", "pass"])
    killed_writer.wait()
    abandoned = converted_dir() / f".{sha256[:16]}.partial-{killed_writer.pid}"
    abandoned.mkdir(parents=True)
    first = load_model(str(tiny_gguf))
    copy = converted_path(sha256)
    assert sorted(p.name for p in converted_dir().iterdir()) == [sha256[:16]]  # no partial directory left
    assert (copy / "model.safetensors").is_file() and (copy / "tokenizer.json").is_file()
    assert "quantization_config" not in json.loads((copy / "config.json").read_text())
    assert first.name == "tiny-llama"
    assert first.model_id == f"tiny-llama@{sha256[:12]}"
    assert (first.config.num_hidden_layers, first.config.num_key_value_heads, first.context_length) == (2, 1, 256)
    assert first.tokenizer.decode(first.tokenizer("the theme")["input_ids"]) == "the theme"

    monkeypatch.setattr(loader, "_convert_gguf", lambda *args: pytest.fail("converted twice"))
    second = load_model(str(tiny_gguf))
    for a, b in zip(first.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_interrupted_conversion_leaves_no_cache(tiny_gguf, cache, monkeypatch):
    class TokenizerInterruptedWhileSaving:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            return TokenizerInterruptedWhileSaving()

        def save_pretrained(self, directory):
            raise KeyboardInterrupt

    monkeypatch.setattr(loader, "AutoTokenizer", TokenizerInterruptedWhileSaving)
    with pytest.raises(KeyboardInterrupt):
        load_model(str(tiny_gguf))
    assert list(converted_dir().iterdir()) == []


def test_corrupt_gguf_is_a_model_error(tmp_path, cache):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(ModelError, match=f"cannot load {path}"):
        load_model(str(path))


def test_registry_model_not_installed_is_not_pulled_when_told_not_to(make_fake):
    make_fake("fake-remote", [10], installed=False)
    with pytest.raises(ModelError, match="model fake-remote is not installed: run `kvtier models pull fake-remote`"):
        load_model("fake-remote", pull_if_missing=False)


@pytest.mark.model
def test_smollm2_loads_from_its_safetensors_copy(monkeypatch):
    llm = load_model("smollm2-135m")  # converts on the first run on a machine
    config = llm.config
    shape = (config.model_type, config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
    assert shape == ("llama", 30, 3, 64)
    assert llm.context_length == 8192
    assert llm.model_id == "smollm2-135m@b179c9523d0e"
    assert llm.has_chat_template is True
    messages = [{"role": "user", "content": "hi"}]
    prompt = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")

    monkeypatch.setattr(loader, "_convert_gguf", lambda *args: pytest.fail("converted again"))
    again = load_model("smollm2-135m")
    assert torch.equal(again.model.model.embed_tokens.weight, llm.model.model.embed_tokens.weight)


def test_dummy_format_needs_only_config_and_tokenizer_and_is_seeded(tiny_hf_dir, tmp_path):
    no_weights = _copy_of(tiny_hf_dir, tmp_path / "no-weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelError):  # the default format insists on the weights
        load_model(str(no_weights))
    first, second = (load_model(str(no_weights), dtype="bfloat16", load_format="dummy") for _ in range(2))
    assert first.model_id == f"hf:{no_weights.resolve()}+dummy-weights"  # never shares KV files with real weights
    assert first.dtype == torch.bfloat16 and first.model.training is False
    assert first.tokenizer("the sea")["input_ids"] == [2, 7]
    weight = first.model.model.layers[1].self_attn.k_proj.weight
    assert torch.equal(weight, second.model.model.layers[1].self_attn.k_proj.weight)
    saved = load_file(tiny_hf_dir / "model.safetensors")["model.layers.1.self_attn.k_proj.weight"]
    assert not torch.equal(weight.float(), saved)
    with pytest.raises(ConfigError, match="unknown load format 'fast'"):
        load_model(str(no_weights), load_format="fast")
