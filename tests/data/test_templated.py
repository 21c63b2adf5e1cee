"""kvtier.data.templated: templated log and form sentences, deterministic and highly repetitive."""

import re

from kvtier.data.templated import templated_text


def test_templated_text_is_deterministic_and_grows_by_extension():
    short = templated_text(3_000, seed=1)
    assert short == templated_text(3_000, seed=1) and len(short) >= 3_000
    assert templated_text(30_000, seed=1).startswith(short)
    assert templated_text(3_000, seed=2) != short


def test_sentences_repeat_their_words_and_differ_in_their_numbers():
    lines = templated_text(100_000).splitlines()
    assert len(lines) > 800 and all(line.endswith(".") for line in lines)
    shapes = {re.sub(r"\d+", "#", re.sub(r"\b(orders|billing|search|accounts|inventory)\b", "S", line))
              for line in lines}
    assert len(shapes) <= 12  # a few templates x statuses: almost every sentence repeats one shape
    assert len(set(lines)) / len(lines) > 0.95  # ...with other numbers
    assert len({word.lower() for word in re.findall(r"[A-Za-z]+", " ".join(lines))}) < 60
