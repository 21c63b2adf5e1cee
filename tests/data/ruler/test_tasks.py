"""The RULER-style tasks: deterministic by seed, fitted to the context, expected answers where they belong."""

import collections
import re

import pytest

from kvtier.data.ruler import FAMILIES, TASKS, family, make_sample
from kvtier.data.ruler.niah import NEEDLE_TASKS
from kvtier.data.ruler.tracking import HOPS
from kvtier.errors import ConfigError

CONTEXT = 1500


@pytest.fixture(scope="module")
def measure(tokenizers_by_kind):
    tokenizer = tokenizers_by_kind["byte_level_bpe"]
    return lambda sample: len(tokenizer(f"{sample.context}\n{sample.answer_prefix}")["input_ids"])


@pytest.mark.parametrize("task", TASKS)
def test_a_sample_is_deterministic_by_seed_and_fills_its_context(task, measure, corpus_text):
    sample = make_sample(task, 3, CONTEXT, measure, corpus_text)
    assert sample == make_sample(task, 3, CONTEXT, measure, corpus_text)
    assert sample != make_sample(task, 4, CONTEXT, measure, corpus_text)
    assert 0.9 * CONTEXT < measure(sample) + sample.answer_tokens <= CONTEXT
    assert sample.expected and all(sample.expected) and sample.task == task


@pytest.mark.parametrize("task", NEEDLE_TASKS)
def test_each_expected_value_is_a_needle_of_an_asked_key(task, measure, corpus_text):
    sample = make_sample(task, 1, CONTEXT, measure, corpus_text)
    needles = re.findall(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.", sample.context)
    asked = re.search(r"numbers for (.+) mentioned in the provided text\?$", sample.context).group(1)
    values_of_asked = [value for key, value in needles if key in asked]
    task_spec = NEEDLE_TASKS[task]
    assert len(needles) == task_spec.keys * task_spec.values
    assert sorted(values_of_asked) == sorted(sample.expected)
    assert len(sample.expected) == task_spec.asked * task_spec.values
    assert asked in sample.answer_prefix
    assert sample.context.index(needles[0][0]) > sample.context.index("afterwards.")  # inside the document


def test_the_haystacks_differ_as_named(measure, corpus_text):
    essay, noise, random_tokens = (make_sample(f"niah_single_{kind}", 0, CONTEXT, measure, corpus_text).context
                                   for kind in ("essay", "noise", "random"))
    assert essay.split("\n")[1][:40] in corpus_text.replace("\n", " ") or essay.split("\n")[1][:40] in corpus_text
    assert noise.count("The grass is green.") > 10
    assert "The grass is green." not in random_tokens and re.search(r"\b[a-z]*\d[a-z\d]*\b", random_tokens)


def test_variable_tracking_hides_a_chain_in_order_and_asks_every_variable(measure, corpus_text):
    sample = make_sample("vt", 2, CONTEXT, measure, corpus_text)
    value = re.search(r"assigned the value (\d+) in the text above", sample.context).group(1)
    statements = re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", sample.context)
    assert len(statements) == HOPS + 1 and statements[0] == (sample.expected[0], value)
    for (name, source), (previous, _) in zip(statements[1:], statements):
        assert source == f"VAR {previous}"  # each hop refers to the one before, in order of appearance
    assert tuple(name for name, _ in statements) == sample.expected


def test_common_words_are_the_most_frequent_entries_of_the_list(measure, corpus_text):
    sample = make_sample("cwe", 5, CONTEXT, measure, corpus_text)
    entries = re.findall(r"\d+\. ([a-z]+)", sample.context.split("\n")[1])
    counts = collections.Counter(entries)
    assert entries and [f"{i + 1}" for i in range(3)] == re.findall(r"(\d+)\. ", sample.context.split("\n")[1])[:3]
    threshold = counts.most_common(10)[-1][1]
    assert set(sample.expected) == {word for word, count in counts.items() if count >= threshold}
    assert min(counts[word] for word in sample.expected) > max(counts[word] for word in counts
                                                               if word not in sample.expected)


def test_frequent_words_are_the_three_most_frequent_besides_the_dots(measure, corpus_text):
    sample = make_sample("fwe", 6, CONTEXT, measure, corpus_text)
    text = sample.context.split("coded words. ", 1)[1].split("\nQuestion:")[0]
    ranked = [word for word, _ in collections.Counter(text.split()).most_common()]
    assert ranked[0] == "...." and tuple(ranked[1:4]) == sample.expected
    counts = collections.Counter(text.split())
    assert counts[ranked[3]] > counts[ranked[4]]  # no tie at the edge of the answer


def test_every_task_has_a_family_and_unknown_tasks_are_refused(measure, corpus_text):
    assert FAMILIES == ("retrieval", "multi-hop", "aggregation")
    assert {family(task) for task in TASKS} == set(FAMILIES)
    with pytest.raises(ConfigError, match="unknown RULER task 'qa'"):
        make_sample("qa", 0, CONTEXT, measure, corpus_text)
