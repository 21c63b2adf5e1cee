"""Structured output: a grammar (a JSON schema, or any JSON object) compiled by xgrammar, applied as a token mask.

xgrammar is vLLM's default structured-output backend. It compiles a grammar against the
tokenizer's vocabulary once; each sequence then owns a matcher that, at every step, fills a bitmask
of the tokens that keep the output inside the grammar (the sampler sets every other logit to -inf)
and accepts the token chosen. Once the grammar is complete only end-of-sequence is allowed, and the
sequence ends.

JSON is compiled without free whitespace (separators ", " and ": "): a model that may put any
whitespace between JSON tokens can spend its whole budget on it (small models do), and the text is
the same JSON. Tokens holding a raw control character are never allowed: xgrammar's JSON strings
admit them, JSON does not. xgrammar is optional: it installs with --no-deps (`make vllm`, as its own
requirements pull a CUDA torch); asking for structured output without it is a one-line error.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import Any

import torch

from kvtier.errors import ConfigError

CACHED_GRAMMARS = 64  # compiled grammars kept by schema (clients repeat theirs)
_XGRAMMAR_NOISE = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*|Check failed: \(.*?\) is false:\s*")


class GrammarError(ConfigError):
    """A grammar that cannot be compiled (or no xgrammar to compile it); the message names the problem."""


class Matcher:
    """One sequence's place in a grammar: the tokens allowed next, the tokens it took, whether it is complete."""

    def __init__(self, matcher: Any, allowed: torch.Tensor) -> None:
        self._matcher, self._allowed = matcher, allowed

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of an xgrammar bitmask: the tokens allowed next (those holding a raw control character never)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
        bitmask[row] &= self._allowed

    def accept(self, token: int) -> bool:
        return self._matcher.accept_token(token)

    @property
    def complete(self) -> bool:
        return self._matcher.is_terminated()


class Grammar:
    """A compiled grammar; `matcher()` makes the per-sequence state that follows an output through it."""

    def __init__(self, compiled: Any, stop_token_ids: list[int], allowed: torch.Tensor) -> None:
        self._compiled, self._stop_token_ids, self._allowed = compiled, stop_token_ids, allowed

    def matcher(self) -> Matcher:
        import xgrammar

        return Matcher(xgrammar.GrammarMatcher(self._compiled, override_stop_tokens=self._stop_token_ids),
                       self._allowed)


class GrammarCompiler:
    """Compiles response formats for one tokenizer (its vocabulary read on first use, a fraction of a second)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        """`vocab_size`: the model's logit width (it may exceed the tokenizer's); `stop_token_ids`: what ends a
        sequence (the engine's end-of-sequence tokens): a complete grammar allows only these."""
        self._tokenizer, self._vocab_size, self._stop = tokenizer, vocab_size, list(stop_token_ids)
        self._compiler: Any = None
        self._allowed: torch.Tensor | None = None
        self._cache: OrderedDict[str, Grammar] = OrderedDict()

    def json_schema(self, schema: dict[str, Any] | str) -> Grammar:
        """A grammar for JSON valid against `schema`; GrammarError naming what the schema gets wrong."""
        text = schema if isinstance(schema, str) else json.dumps(schema)  # key order is the output's order
        return self._cached(text, lambda compiler: compiler.compile_json_schema(text, any_whitespace=False))

    def json_object(self) -> Grammar:
        """A grammar for any JSON object."""
        return self.json_schema({"type": "object"})

    def _cached(self, key: str, compile_with: Any) -> Grammar:
        grammar = self._cache.get(key)
        if grammar is None:
            try:
                compiled = compile_with(self._xgrammar_compiler())
            except RuntimeError as error:  # xgrammar reports every schema problem as one
                raise GrammarError(f"the schema cannot be compiled: {_clean(error)}") from None
            grammar = self._cache[key] = Grammar(compiled, self._stop, self._allowed)
            while len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return grammar

    def _xgrammar_compiler(self) -> Any:
        if self._compiler is None:
            try:
                import xgrammar
            except ImportError:
                raise GrammarError("structured output needs xgrammar, which is not installed: "
                                   "pip install --no-deps xgrammar==0.2.8 (or `make vllm`)") from None
            info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                           stop_token_ids=self._stop)
            self._compiler = xgrammar.GrammarCompiler(info)
            self._allowed = _without_control_characters(info.decoded_vocab, self._vocab_size)
        return self._compiler


def apply_masks(logits: torch.Tensor, rows: list[int], matchers: list[Matcher]) -> None:
    """Set to -inf every logit of row `rows[i]` that `matchers[i]` does not allow next."""
    if not rows:
        return
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(logits.shape[0], logits.shape[1])
    for row, matcher in zip(rows, matchers):
        matcher.fill(bitmask, row)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)


def _without_control_characters(vocabulary: list[bytes], vocab_size: int) -> torch.Tensor:
    """An xgrammar bitmask row (int32 words, bit t for token t) of the tokens holding no byte below 0x20.

    xgrammar's JSON strings admit raw control characters, which JSON (and strict parsers: Python's,
    JavaScript's) refuse inside a string; with no free whitespace, JSON never needs one outside a string.
    """
    allowed = torch.ones(-(-vocab_size // 32) * 32, dtype=torch.bool)
    allowed[[token for token, text in enumerate(vocabulary) if any(byte < 0x20 for byte in text)]] = False
    words = (allowed.view(-1, 32).long() << torch.arange(32)).sum(dim=1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def _clean(error: Exception) -> str:
    """xgrammar's message without its C++ source location, on one line."""
    return " ".join(_XGRAMMAR_NOISE.sub("", line).strip() for line in str(error).splitlines() if line.strip())
