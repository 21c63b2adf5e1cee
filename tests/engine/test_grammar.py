"""Grammars compiled by xgrammar: a mask the engine's sampler applies, errors that say what is wrong."""

import json
import sys

import pytest
import tiny_models
from transformers import AutoTokenizer

from kvtier.engine.grammar import GrammarCompiler, GrammarError
from kvtier.engine.sampling_params import SamplingError
from kvtier.engine.serving_engine import EngineConfig, LLMEngine
from kvtier.engine.sequence import SamplingParams

pytest.importorskip("xgrammar")

WORDS = ['{', '}', '"', ':', ',', '[', ']', 'a', 'b', 'c', 'true', 'false', 'null', '0', '1', '2', ' ', 'x', 'y']
EOS = 1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random Llama over a word-level vocabulary of JSON's pieces, and its tokenizer."""
    directory = tiny_models.save_tiny_hf_dir(tmp_path_factory.mktemp("json"), WORDS, head_dim=16)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = tiny_models.tiny_llama(vocab_size=len(tokenizer), eos_token_id=EOS, head_dim=16)
    return model, tokenizer, GrammarCompiler(tokenizer, len(tokenizer), [EOS])


def text(tokenizer, ids: list[int]) -> str:
    return "".join(tokenizer.convert_ids_to_tokens([token for token in ids if token != EOS]))


def test_every_sampled_output_matches_the_schema_and_ends_there(tiny):
    model, tokenizer, compiler = tiny
    schema = {"type": "object", "properties": {"x": {"enum": ["a", "b"]}, "y": {"type": "boolean"}},
              "required": ["x", "y"], "additionalProperties": False}  # only words of the vocabulary
    grammar = compiler.json_schema(schema)
    sampling = SamplingParams(max_new_tokens=40, temperature=1.5, seed=3, n=16, grammar=grammar)
    with LLMEngine(model, EngineConfig(block_tokens=16, device_blocks=64, swap="recompute"),
                   eos_token_ids=[EOS]) as engine:
        outputs = engine.generate([[2, 3, 4]], sampling)
        free = engine.generate([[2, 3, 4]], SamplingParams(max_new_tokens=40, temperature=1.5, seed=3))
    values = [json.loads(text(tokenizer, output.token_ids)) for output in outputs]
    assert all(output.finish_reason == "stop" and output.token_ids[-1] == EOS for output in outputs)
    assert all(list(value) == ["x", "y"] and value["x"] in "ab" and isinstance(value["y"], bool) for value in values)
    assert len({json.dumps(value) for value in values}) > 1
    with pytest.raises(ValueError):
        json.loads(text(tokenizer, free[0].token_ids))  # the mask, not the model, wrote the JSON


def test_a_schema_that_cannot_compile_is_one_line_naming_the_problem(tiny):
    compiler = tiny[2]
    for schema, problem in (({"type": "objectx"}, 'Unsupported type "objectx"'),
                            ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum greater than maximum"),
                            ('{"type": ', "Failed to parse JSON")):
        with pytest.raises(GrammarError) as error:
            compiler.json_schema(schema)
        message = str(error.value)
        assert problem in message and "\n" not in message and ".cc:" not in message


def test_compiled_grammars_are_reused_by_schema(tiny):
    compiler = tiny[2]
    assert compiler.json_schema({"type": "boolean"}) is compiler.json_schema({"type": "boolean"})
    assert compiler.json_object() is not compiler.json_schema({"type": "boolean"})


def test_without_xgrammar_asking_for_structured_output_is_one_clear_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # what an absent package looks like to `import`
    with pytest.raises(GrammarError, match="needs xgrammar, which is not installed") as error:
        GrammarCompiler(tokenizer=None, vocab_size=10, stop_token_ids=[0]).json_object()
    assert "\n" not in str(error.value)


def test_min_tokens_cannot_be_combined_with_a_grammar(tiny):
    with pytest.raises(SamplingError, match="min_tokens"):
        SamplingParams(min_tokens=2, grammar=tiny[2].json_object())


def test_a_grammar_the_vocabulary_cannot_write_ends_its_request_alone_with_an_error(tiny):
    model, _, compiler = tiny
    unwritable = compiler.json_schema({"enum": ["zebra"]})  # no token spells it
    with LLMEngine(model, EngineConfig(block_tokens=16, device_blocks=64, swap="recompute"),
                   eos_token_ids=[EOS]) as engine:
        failing = engine.add_request([2, 3], SamplingParams(max_new_tokens=5, grammar=unwritable))
        fine = engine.add_request([4, 5], SamplingParams(max_new_tokens=5, ignore_eos=True))
        outputs = {}
        while engine.has_unfinished():
            outputs.update((output.request_id, output) for output in engine.step())
    assert outputs[failing].finish_reason == "error" and "grammar allows no token" in outputs[failing].warnings[0]
    assert outputs[fine].finish_reason == "length" and len(outputs[fine].token_ids) == 5
