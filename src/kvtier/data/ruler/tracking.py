"""RULER's variable tracking (multi-hop): a chain of assignments hidden in noise, every variable of it asked.

"VAR ABCDE = 12345", then "VAR FGHIJ = VAR ABCDE" and so on for `HOPS` hops, each statement at a random depth
of RULER's noise haystack, in chain order. The question gives the value; the answer must name every variable
of the chain (string_match_all), which takes following each hop back to the one before.
"""

from __future__ import annotations

import random
import string

from kvtier.data.ruler.haystacks import insert, noise
from kvtier.data.ruler.sample import RulerSample

HOPS = 4
NAME_LETTERS = 5


def tracking_sample(name: str, seed: int, size: int, corpus_text: str = "") -> RulerSample:
    """The variable-tracking sample for `seed` in `size` repeats of the noise sentences."""
    rng = random.Random(f"{name}:{seed}")
    variables: list[str] = []
    while len(variables) < HOPS + 1:  # distinct names
        candidate = "".join(rng.choices(string.ascii_uppercase, k=NAME_LETTERS))
        if candidate not in variables:
            variables.append(candidate)
    value = str(rng.randint(10_000, 99_999))
    chain = [f"VAR {variables[0]} = {value}."] + [f"VAR {variables[i + 1]} = VAR {variables[i]}."
                                                   for i in range(HOPS)]
    depths = sorted(rng.random() for _ in chain)
    document = " ".join(insert(noise(size), chain, depths))
    return RulerSample(
        task=name,
        context=f"Memorize and track the chain of variable assignments hidden in the following text.\n\n{document}\n"
                f"Question: Find all variables that are assigned the value {value} in the text above.",
        answer_prefix=f"Answer: According to the chain of variable assignments in the text above, {HOPS + 1} "
                      f"variables are assigned the value {value}, they are:",
        expected=tuple(variables),
        answer_tokens=28,
    )
