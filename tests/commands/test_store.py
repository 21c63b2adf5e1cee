"""`kvtier generate --kv-store` and `kvtier store list|remove|clear` end to end on a tiny local model."""

import errno
import json
import os

from kvtier.cli import main
from kvtier.docstore import document_store
from kvtier.docstore.document_store import DocumentStore

DOCUMENT = "the keeper of the blue lighthouse is what the sea ship light answer " * 60
QUESTION = "what is the code of the red lighthouse"


def _ask(model_dir, store_dir, *extra):
    return main(["generate", "--model", str(model_dir), "--prompt", f"{DOCUMENT} {QUESTION}", "--max-new-tokens", "4",
                 "--json", "--kv-store", str(store_dir), *extra])


def _last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_the_second_run_reuses_the_first_runs_prompt(tiny_model_dir, tmp_path, capsys):
    assert _ask(tiny_model_dir, tmp_path / "store") == 0
    first = _last_json(capsys)
    assert _ask(tiny_model_dir, tmp_path / "store") == 0
    second = _last_json(capsys)
    assert first["reused_prompt_tokens"] == 0 and second["reused_prompt_tokens"] >= 512
    assert second["token_ids"] == first["token_ids"] and second["ttft_s"] > 0


def test_no_kv_store_neither_reads_nor_writes(tiny_model_dir, tmp_path, capsys):
    assert _ask(tiny_model_dir, tmp_path / "store", "--no-kv-store") == 0
    assert _last_json(capsys)["reused_prompt_tokens"] == 0
    assert not (tmp_path / "store").exists()


def test_store_list_remove_and_clear(tiny_model_dir, tmp_path, capsys):
    _ask(tiny_model_dir, tmp_path / "store")
    capsys.readouterr()
    assert main(["store", "list", "--kv-store", str(tmp_path / "store")]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert listing[0].split()[:3] == ["ID", "TOKENS", "SIZE"] and "the keeper of the blue" in listing[1]
    entry_id, size = listing[1].split()[0], listing[1].split()[2]
    assert listing[-1] == f"1 entry, {size} in {tmp_path / 'store'}"
    assert main(["store", "remove", entry_id[:8], "--kv-store", str(tmp_path / "store")]) == 0
    assert capsys.readouterr().out == f"removed {entry_id} ({size})\n"
    _ask(tiny_model_dir, tmp_path / "store")
    capsys.readouterr()
    assert main(["store", "clear", "--kv-store", str(tmp_path / "store")]) == 0
    assert capsys.readouterr().out == f"removed 1 entry ({size}) from {tmp_path / 'store'}\n"


def test_a_remove_that_fails_exits_2_naming_the_entry_and_the_entry_stays(tiny_model_dir, tmp_path, capsys,
                                                                           monkeypatch):
    _ask(tiny_model_dir, tmp_path / "store")
    (entry,) = DocumentStore(tmp_path / "store").entries()
    capsys.readouterr()

    def read_only(*_):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(document_store.os, "rename", read_only)
    assert main(["store", "remove", entry.id, "--kv-store", str(tmp_path / "store")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"kvtier: error: cannot remove KV store entry {entry.id} from {tmp_path / 'store'}: "
                            "Read-only file system\n")
    monkeypatch.undo()
    assert [kept.id for kept in DocumentStore(tmp_path / "store").entries()] == [entry.id]


def test_list_and_clear_of_a_missing_store_create_nothing(tmp_path, capsys):
    missing = tmp_path / "missing"
    assert main(["store", "list", "--kv-store", str(missing)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"0 entries, 0B in {missing}"
    assert main(["store", "clear", "--kv-store", str(missing)]) == 0
    assert capsys.readouterr().out == f"removed 0 entries (0B) from {missing}\n"
    assert not missing.exists()


def test_an_unknown_entry_and_a_store_path_that_is_a_file_are_one_line_errors(tmp_path, capsys):
    assert main(["store", "remove", "abc", "--kv-store", str(tmp_path / "store")]) == 2
    assert capsys.readouterr().err.strip() == (f"kvtier: error: there is no KV store at {tmp_path / 'store'}; "
                                               "nothing to remove")
    (tmp_path / "store").mkdir()
    assert main(["store", "remove", "abc", "--kv-store", str(tmp_path / "store")]) == 2
    assert capsys.readouterr().err.strip() == ("kvtier: error: no KV store entry starts with 'abc'; "
                                               "see `kvtier store list`")
    (tmp_path / "file").write_text("not a directory")
    assert main(["store", "list", "--kv-store", str(tmp_path / "file")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"kvtier: error: --kv-store {tmp_path / 'file'} is a file;") and "\n" not in error
