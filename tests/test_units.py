"""Counts with their noun: what `store list`, `store clear` and the context errors print."""

import pytest

from kvtier.units import counted


@pytest.mark.parametrize("count, expected", [(0, "0 entries"), (1, "1 entry"), (2, "2 entries")])
def test_a_count_takes_its_nouns_number(count, expected):
    assert counted(count, "entry", "entries") == expected


def test_the_plural_is_the_noun_and_s_unless_given():
    assert (counted(1, "token"), counted(7, "token")) == ("1 token", "7 tokens")
