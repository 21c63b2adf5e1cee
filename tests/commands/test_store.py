"""`kvtier generate --kv-store` and `kvtier store list|remove|clear` end to end on a tiny local model."""

import json

from kvtier.cli import main

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
    entry_id = listing[1].split()[0]
    assert listing[-1].startswith("1 entries")
    assert main(["store", "remove", entry_id[:8], "--kv-store", str(tmp_path / "store")]) == 0
    assert f"removed {entry_id}" in capsys.readouterr().out
    _ask(tiny_model_dir, tmp_path / "store")
    capsys.readouterr()
    assert main(["store", "clear", "--kv-store", str(tmp_path / "store")]) == 0
    assert "removed 1 entries" in capsys.readouterr().out


def test_an_unknown_entry_and_a_store_path_that_is_a_file_are_one_line_errors(tmp_path, capsys):
    assert main(["store", "remove", "abc", "--kv-store", str(tmp_path / "store")]) == 2
    assert capsys.readouterr().err.strip() == ("kvtier: error: no KV store entry starts with 'abc'; "
                                               "see `kvtier store list`")
    (tmp_path / "file").write_text("not a directory")
    assert main(["store", "list", "--kv-store", str(tmp_path / "file")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("kvtier: error: cannot use KV store") and "\n" not in error
