"""kvtier.data.needle: needles, haystack length and depth with real (locally trained) tokenizers, scoring."""

import pytest

from kvtier.data.needle import build_haystack, make_needles, score_answer, split_sentences
from kvtier.errors import ConfigError


def _tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _squash(text: str) -> str:
    return " ".join(text.split())


# ---------------------------------------------------------------- needles


def test_needles_are_distinct_deterministic_facts_with_questions():
    needles = make_needles(8, seed=5)
    assert needles == make_needles(8, seed=5)
    assert needles != make_needles(8, seed=6)
    assert len({n.key for n in needles}) == 8 and len({n.value for n in needles}) == 8
    for needle in needles:
        assert needle.sentence == f"The {needle.key} is {needle.value}."
        assert needle.question == f"What is the {needle.key}? Answer with the number only."
        assert needle.value.isdigit() and len(needle.value) == 4


def test_similar_keys_differ_in_one_word_only():
    needles = make_needles(5, seed=2, similar_keys=True)
    word_lists = [n.key.split() for n in needles]
    differing = [i for i in range(len(word_lists[0])) if len({words[i] for words in word_lists}) > 1]
    assert len(differing) == 1
    assert len({n.key for n in needles}) == 5


def test_too_many_similar_keys_is_a_config_error():
    with pytest.raises(ConfigError, match="similar-key needles"):
        make_needles(100, seed=0, similar_keys=True)


# ---------------------------------------------------------------- sentences


def test_split_sentences_joins_back_and_cuts_after_sentence_ends():
    text = 'First one. "Second," he said! Third?\n\n\n\nACT II\nFourth line [Exit.] Fifth'
    pieces = split_sentences(text)
    assert "".join(pieces) == text
    assert pieces == ["First one.", ' "Second," he said!', " Third?", "\n\n\n\nACT II\nFourth line [Exit.]", " Fifth"]


# ---------------------------------------------------------------- haystacks


@pytest.mark.parametrize("target", [1_000, 6_000])
def test_haystack_length_is_close_to_the_target(tokenizer, corpus_text, target):
    prompt = build_haystack(tokenizer, corpus_text, target, make_needles(1, seed=0), [0.5])
    assert prompt.context_tokens == _tokens(tokenizer, prompt.document)
    assert abs(prompt.context_tokens - target) <= 0.02 * target


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.65, 1.0])
def test_needle_sits_at_the_requested_depth(tokenizer, corpus_text, depth):
    needle = make_needles(1, seed=3)[0]
    prompt = build_haystack(tokenizer, corpus_text, 3_000, [needle], [depth])
    (position,) = prompt.needle_token_positions
    start = prompt.document.index(needle.sentence)
    assert prompt.document.count(needle.sentence) == 1
    assert position == _tokens(tokenizer, prompt.document[:start].rstrip())
    assert abs(position - depth * prompt.context_tokens) <= 0.02 * prompt.context_tokens
    assert abs(start - depth * len(prompt.document)) <= 0.03 * len(prompt.document)


def test_haystack_is_the_head_of_the_corpus_around_the_needles(tokenizer, corpus_text):
    needles = make_needles(2, seed=4)
    prompt = build_haystack(tokenizer, corpus_text, 2_000, needles, [0.3, 0.7])
    hay = prompt.document
    for needle in needles:
        hay = hay.replace(needle.sentence, "")
    assert _squash(corpus_text).startswith(_squash(hay))
    assert prompt.document.endswith(".")


def test_multi_needle_asks_the_chosen_one_and_orders_by_depth(bpe_tokenizer, corpus_text):
    needles = make_needles(3, seed=8)
    prompt = build_haystack(bpe_tokenizer, corpus_text, 4_000, needles, [0.8, 0.2, 0.5], ask=2)
    assert (prompt.question, prompt.expected) == (needles[2].question, needles[2].value)
    assert prompt.distractors == (needles[0].value, needles[1].value)
    starts = [prompt.document.index(n.sentence) for n in needles]
    assert starts[1] < starts[2] < starts[0]
    assert prompt.needle_token_positions[1] < prompt.needle_token_positions[2] < prompt.needle_token_positions[0]
    assert prompt.prompt == f"{prompt.document}\n\n{needles[2].question}"


def test_multi_key_document_holds_every_distractor(bpe_tokenizer, corpus_text):
    needles = make_needles(4, seed=9, similar_keys=True)
    prompt = build_haystack(bpe_tokenizer, corpus_text, 2_000, needles, [0.1, 0.4, 0.6, 0.9], ask=1)
    assert all(prompt.document.count(n.sentence) == 1 for n in needles)
    asked_adjective = needles[1].key.split()[-2]
    assert asked_adjective in prompt.question
    assert not any(n.key.split()[-2] in prompt.question for i, n in enumerate(needles) if i != 1)
    assert set(prompt.distractors) == {n.value for i, n in enumerate(needles) if i != 1}


def test_many_needles_each_sit_at_their_depth(bpe_tokenizer, corpus_text):
    depths = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    prompt = build_haystack(bpe_tokenizer, corpus_text, 1_000, make_needles(6, seed=2), depths)
    for position, depth in zip(prompt.needle_token_positions, depths):
        assert abs(position - depth * prompt.context_tokens) <= 0.03 * prompt.context_tokens


def test_needles_at_the_same_depth_keep_their_order(bpe_tokenizer, corpus_text):
    needles = make_needles(2, seed=1)
    prompt = build_haystack(bpe_tokenizer, corpus_text, 1_000, needles, [0.5, 0.5])
    assert f"{needles[0].sentence} {needles[1].sentence}" in prompt.document


@pytest.mark.parametrize(
    ("context", "depths", "ask", "message"),
    [
        (1_000, [0.5, 0.5], 0, "1 needles but 2 depths"),
        (1_000, [1.5], 0, r"depths must lie in \[0, 1\]"),
        (1_000, [0.5], 3, "ask=3"),
        (5, [0.5], 0, "cannot hold the needles"),
    ],
)
def test_impossible_requests_are_config_errors(bpe_tokenizer, corpus_text, context, depths, ask, message):
    with pytest.raises(ConfigError, match=message):
        build_haystack(bpe_tokenizer, corpus_text, context, make_needles(1, seed=0), depths, ask=ask)


def test_corpus_too_short_for_the_context_is_a_config_error(bpe_tokenizer, corpus_text):
    with pytest.raises(ConfigError, match="min_chars of at least"):
        build_haystack(bpe_tokenizer, corpus_text[:3_000], 2_000, make_needles(1, seed=0), [0.5])


# ---------------------------------------------------------------- scoring


@pytest.mark.parametrize(
    ("answer", "correct"),
    [
        ("7314", True),
        ("The secret code of the blue lighthouse is 7,314.", True),
        ("**7314**\n", True),
        ("73140", False),
        ("17314", False),
        ("I don't know.", False),
        ("", False),
    ],
)
def test_score_answer_needs_the_value_as_a_whole_number(answer, correct):
    assert score_answer(answer, "7314") is correct


def test_naming_a_distractor_too_is_not_an_answer():
    assert score_answer("It is 7314.", "7314", distractors=["5120"])
    assert not score_answer("Either 7314 or 5120.", "7314", distractors=["5120"])
