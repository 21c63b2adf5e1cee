"""RULER's needle-in-a-haystack tasks: single needles in three haystacks, multi-key, multi-value, multi-query.

A needle is "One of the special magic numbers for {key} is: {value}." with a key of two words joined by a
hyphen and a seven-digit value, as in RULER. Needles sit at random depths of the haystack (seeded); the
question asks for the values of one key (or four, multi-query), and an answer scores the share of the
expected values it names (RULER's string_match_all):

    niah_single_{essay,noise,random}  one needle, one value, in each haystack
    niah_multikey     four needles with different keys in essay text, one asked (the others distract)
    niah_multivalue   one key with four values, all asked
    niah_multiquery   four needles, all four keys asked
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvtier.data.ruler.haystacks import haystack, insert
from kvtier.data.ruler.sample import RulerSample

_FIRST = ("lively", "quiet", "ancient", "hollow", "bright", "crooked", "gentle", "frozen", "hidden", "silver",
          "rapid", "bitter", "humble", "curious", "polite", "restless", "tidy", "wicked", "vivid", "sleepy")
_SECOND = ("garden", "anchor", "violin", "lantern", "harbor", "pepper", "meadow", "ladder", "compass", "tunnel",
           "orchard", "kettle", "falcon", "marble", "pillow", "canyon", "ribbon", "saddle", "thunder", "walnut")
INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
         "I will quiz you about the numbers afterwards.")


@dataclass(frozen=True)
class NeedleTask:
    """One needle task: its haystack, how many keys and values per key it plants, how many keys it asks."""

    haystack: str
    keys: int = 1
    values: int = 1  # per key
    asked: int = 1  # keys asked (the first `asked` planted)
    answer_tokens: int = 16  # a seven-digit value and the words before it


NEEDLE_TASKS = {
    "niah_single_essay": NeedleTask("essay"),
    "niah_single_noise": NeedleTask("noise"),
    "niah_single_random": NeedleTask("random"),
    "niah_multikey": NeedleTask("essay", keys=4),
    "niah_multivalue": NeedleTask("essay", values=4, answer_tokens=40),
    "niah_multiquery": NeedleTask("essay", keys=4, asked=4, answer_tokens=40),
}


def needle_sample(name: str, seed: int, size: int, corpus_text: str) -> RulerSample:
    """Task `name`'s sample for `seed` with a haystack of `size` sentences (noise: `size` repeats)."""
    task = NEEDLE_TASKS[name]
    rng = random.Random(f"{name}:{seed}")
    keys = ["-".join(pair) for pair in rng.sample([(a, b) for a in _FIRST for b in _SECOND], task.keys)]
    values = {key: [str(value) for value in rng.sample(range(1_000_000, 10_000_000), task.values)] for key in keys}
    needles = [f"One of the special magic numbers for {key} is: {value}." for key in keys for value in values[key]]
    depths = [rng.random() for _ in needles]
    rng.shuffle(needles)  # a key's values do not stand in order of depth
    document = " ".join(insert(haystack(task.haystack, size, seed, corpus_text), needles, depths))
    asked = keys[: task.asked]
    query = asked[0] if len(asked) == 1 else ", ".join(asked[:-1]) + ", and " + asked[-1]
    return RulerSample(
        task=name,
        context=f"{INTRO}\n{document}\nWhat are all the special magic numbers for {query} mentioned in the "
                "provided text?",
        answer_prefix=f"The special magic numbers for {query} mentioned in the provided text are",
        expected=tuple(value for key in asked for value in values[key]),
        answer_tokens=task.answer_tokens,
    )
