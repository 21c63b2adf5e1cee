"""Needle-in-a-haystack prompts: plant short facts in long text at chosen depths, ask for one.

A needle is a sentence such as "The secret code of the blue lighthouse is 7314.". The
haystack is the head of a corpus cut at sentence boundaries to about `context_tokens`
tokens of the model's own tokenizer, with each needle inserted at its depth (0 = first
sentence, 1 = last). Several needles with unrelated keys make a multi-needle prompt;
several needles whose keys differ in one word (`make_needles(similar_keys=True)`) make a
multi-key prompt, where the others are distractors for the one asked.

Token counts come from `tokenizer(texts, add_special_tokens=False)`, so any Hugging Face
tokenizer works. Sentences are counted one by one and the sum is corrected against a
count of the whole document, because tokenizers merge or add tokens at piece boundaries.
"""

import bisect
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# The prompts above by name: one needle, several with unrelated keys, several with similar keys (the needle
# grids' variants; kvtier.eval.accuracy.needle_grid builds each).
VARIANTS = ("single", "multi-needle", "multi-key")

_ATTRIBUTES = ("secret code", "access number", "lucky number", "room number", "combination", "passcode")
_ADJECTIVES = (
    "blue", "red", "green", "silver", "golden", "crimson", "amber", "violet", "white", "black", "copper",
    "purple", "orange", "yellow", "grey", "scarlet", "ivory", "emerald", "bronze", "pink",
)
_PLACES = (
    "lighthouse", "garden", "library", "harbour", "bridge", "tower", "observatory", "bakery", "museum",
    "windmill", "chapel", "greenhouse", "warehouse", "theatre", "boathouse", "castle", "station", "barn",
)
# Four-digit values above any year the corpora mention, so no value also occurs in the text by chance.
_VALUES = range(3000, 10000)

# Where one sentence ends and the next (with its leading whitespace) begins; also before blank lines.
_SENTENCE_BOUNDARY = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"'”’)\]]))(?=\s)|(?=\n[ \t]*\n)")
_COUNT_BATCH = 256
_CORRECTION_ROUNDS = 3
_TOLERANCE = 0.005


@dataclass(frozen=True)
class Needle:
    key: str  # "secret code of the blue lighthouse"
    value: str  # "7314"
    sentence: str  # "The secret code of the blue lighthouse is 7314."

    @property
    def question(self) -> str:
        return f"What is the {self.key}? Answer with the number only."


@dataclass(frozen=True)
class HaystackPrompt:
    """A document with needles in it and the question for one of them.

    `needle_token_positions[i]` is the token index, within `document` alone, where the i-th
    needle passed to `build_haystack` begins; add the length of whatever the prompt puts
    before the document (chat template, `prompt`'s lead) to map it onto the model input.
    """

    document: str
    question: str
    expected: str
    needle_token_positions: tuple[int, ...]
    context_tokens: int  # tokens of `document`, measured
    distractors: tuple[str, ...] = ()  # values of the needles not asked

    @property
    def prompt(self) -> str:
        """Document then question: small models answer best when the question comes last."""
        return f"{self.document}\n\n{self.question}"


def make_needles(n: int, seed: int, similar_keys: bool = False) -> list[Needle]:
    """`n` facts with distinct keys and distinct four-digit values.

    With `similar_keys`, all keys share attribute and place and differ only in the adjective
    ("secret code of the blue lighthouse", "... of the red lighthouse"): a multi-key prompt.
    """
    rng = random.Random(seed)
    if similar_keys:
        if not 1 <= n <= len(_ADJECTIVES):
            raise ConfigError(f"similar-key needles: n={n} must be between 1 and {len(_ADJECTIVES)}")
        attribute, place = rng.choice(_ATTRIBUTES), rng.choice(_PLACES)
        keys = [f"{attribute} of the {adjective} {place}" for adjective in rng.sample(_ADJECTIVES, n)]
    else:
        all_keys = [f"{a} of the {adj} {p}" for a in _ATTRIBUTES for adj in _ADJECTIVES for p in _PLACES]
        if not 1 <= n <= len(all_keys):
            raise ConfigError(f"needles: n={n} must be between 1 and {len(all_keys)}")
        keys = rng.sample(all_keys, n)
    values = [str(value) for value in rng.sample(_VALUES, n)]
    return [Needle(key, value, f"The {key} is {value}.") for key, value in zip(keys, values)]


def split_sentences(text: str) -> list[str]:
    """Pieces of `text` that join back to it; each after the first starts with the whitespace before it."""
    pieces: list[str] = []
    pending_space = ""  # runs of blank lines split into whitespace-only pieces; they lead the next sentence
    for piece in _SENTENCE_BOUNDARY.split(text):
        if piece.strip():
            pieces.append(pending_space + piece)
            pending_space = ""
        else:
            pending_space += piece
    if pending_space and pieces:
        pieces[-1] += pending_space
    return pieces


def build_haystack(
    tokenizer: "PreTrainedTokenizerBase",
    corpus_text: str,
    context_tokens: int,
    needles: Sequence[Needle],
    depths: Sequence[float],
    ask: int = 0,
) -> HaystackPrompt:
    """About `context_tokens` tokens of `corpus_text` with `needles[i]` at `depths[i]`, asking for `needles[ask]`.

    Raises:
        ConfigError: mismatched needles/depths, a depth outside [0, 1], `ask` out of range, a
            context too small for the needles, or a corpus too short for the context.
    """
    _check_request(context_tokens, needles, depths, ask)
    needle_counts = _token_counts(tokenizer, [needle.sentence for needle in needles])
    hay_budget = context_tokens - sum(needle_counts)
    if hay_budget <= 0:
        raise ConfigError(f"context of {context_tokens} tokens cannot hold the needles ({sum(needle_counts)} tokens)")
    pieces, counts = _head_sentences(tokenizer, corpus_text, hay_budget)
    cumulative = _cumulative(counts)
    scale = 1.0  # measured tokens per summed sentence token
    for _ in range(_CORRECTION_ROUNDS):
        kept = _prefix_length(cumulative, hay_budget / scale)
        document, needle_starts = _assemble(pieces[:kept], cumulative[: kept + 1], needles, needle_counts, depths)
        measured = _token_counts(tokenizer, [document])[0]
        if abs(measured - context_tokens) <= _TOLERANCE * context_tokens:
            break
        scale = (measured - sum(needle_counts)) / max(cumulative[kept], 1)
    prefixes = [document[:start].rstrip() for start in needle_starts]
    return HaystackPrompt(
        document=document,
        question=needles[ask].question,
        expected=needles[ask].value,
        needle_token_positions=tuple(_token_counts(tokenizer, prefixes)),
        context_tokens=measured,
        distractors=tuple(needle.value for i, needle in enumerate(needles) if i != ask),
    )


def score_answer(text: str, expected: str, distractors: Sequence[str] = ()) -> bool:
    """True when `expected` occurs as a whole word in `text` (case, punctuation, digit grouping ignored)
    and no distractor value does: naming every code in the document is not an answer."""
    answer = f" {_normalise(text)} "
    if any(f" {_normalise(value)} " in answer for value in distractors):
        return False
    return f" {_normalise(expected)} " in answer


def _normalise(text: str) -> str:
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text.lower())  # "7,314" reads as 7314
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text).split())


def _check_request(context_tokens: int, needles: Sequence[Needle], depths: Sequence[float], ask: int) -> None:
    if not needles:
        raise ConfigError("build_haystack needs at least one needle")
    if len(depths) != len(needles):
        raise ConfigError(f"build_haystack: {len(needles)} needles but {len(depths)} depths; give one depth per needle")
    if any(not 0.0 <= depth <= 1.0 for depth in depths):
        raise ConfigError(f"needle depths must lie in [0, 1], got {list(depths)}")
    if not 0 <= ask < len(needles):
        raise ConfigError(f"ask={ask} is not the index of one of the {len(needles)} needles")
    if context_tokens <= 0:
        raise ConfigError(f"context_tokens must be positive, got {context_tokens}")


def _token_counts(tokenizer: "PreTrainedTokenizerBase", texts: list[str]) -> list[int]:
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def _head_sentences(tokenizer: "PreTrainedTokenizerBase", text: str, budget: int) -> tuple[list[str], list[int]]:
    """Leading sentences of `text` and their token counts, a quarter past `budget` so that the correction can grow."""
    pieces = split_sentences(text)
    counts: list[int] = []
    total = 0
    for start in range(0, len(pieces), _COUNT_BATCH):
        counts += _token_counts(tokenizer, pieces[start : start + _COUNT_BATCH])
        total = sum(counts)
        if total >= 1.25 * budget:
            break
    if total < budget:
        raise ConfigError(
            f"corpus text holds about {total} tokens, fewer than the {budget} the haystack needs; "
            f"load the corpus with min_chars of at least {8 * budget}"
        )
    return pieces[: len(counts)], counts


def _cumulative(counts: list[int]) -> list[int]:
    """cumulative[j] = tokens before sentence j; cumulative[-1] = all of them."""
    totals = [0]
    for count in counts:
        totals.append(totals[-1] + count)
    return totals


def _prefix_length(cumulative: list[int], budget: float) -> int:
    """How many leading sentences bring the token count closest to `budget`."""
    return _nearest_boundary(cumulative, budget, low=1)


def _nearest_boundary(cumulative: list[int], target: float, low: int = 0) -> int:
    """Index j >= low with cumulative[j] closest to `target`."""
    right = min(max(bisect.bisect_left(cumulative, target), low), len(cumulative) - 1)
    left = max(right - 1, low)
    return left if abs(cumulative[left] - target) <= abs(cumulative[right] - target) else right


def _assemble(
    pieces: list[str],
    cumulative: list[int],
    needles: Sequence[Needle],
    needle_counts: list[int],
    depths: Sequence[float],
) -> tuple[str, list[int]]:
    """The document with every needle at the sentence boundary nearest its depth, and each needle's start character."""
    total = cumulative[-1] + sum(needle_counts)
    inserted_before = 0  # needle tokens already placed ahead of the boundary being chosen
    insert_at: dict[int, list[int]] = {}  # boundary -> needle indices, shallowest first
    lowest = 0
    for i in sorted(range(len(needles)), key=lambda i: depths[i]):
        boundary = _nearest_boundary(cumulative, depths[i] * total - inserted_before, low=lowest)
        insert_at.setdefault(boundary, []).append(i)
        inserted_before += needle_counts[i]
        lowest = boundary

    parts: list[str] = []
    starts = [0] * len(needles)
    length = 0
    for boundary in range(len(pieces) + 1):
        for i in insert_at.get(boundary, []):
            length = _append(parts, needles[i].sentence, length)
            starts[i] = length - len(needles[i].sentence)
        if boundary < len(pieces):
            length = _append(parts, pieces[boundary], length)
    return "".join(parts), starts


def _append(parts: list[str], piece: str, length: int) -> int:
    """Append `piece`, separated from what precedes it by whitespace; returns the new length."""
    if not parts:
        piece = piece.lstrip()
    elif not piece[:1].isspace():
        piece = " " + piece
    parts.append(piece)
    return length + len(piece)
