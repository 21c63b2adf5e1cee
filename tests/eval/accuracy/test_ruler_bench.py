"""`kvtier bench ruler`'s experiment on a tiny random model: every suite mode answers, cells are kept, offload is
checked against dense (mechanics, not scores)."""

import json

import pytest
import torch

from kvtier.eval.accuracy import ruler_bench
from kvtier.eval.accuracy.budgets import BudgetShares
from kvtier.eval.accuracy.ruler_bench import ModesDiffer, RulerOptions, run_ruler
from kvtier.eval.accuracy.ruler_grid import SUITE_MODES
from kvtier.modes import KVConfig, make_cache

TASKS = ["niah_single_noise", "vt", "fwe"]  # one task of each family
CONTEXT = 600


def _run(llm, tmp_path, modes=tuple(SUITE_MODES), tasks=TASKS):
    (tmp_path / "kv").mkdir(exist_ok=True)
    options = RulerOptions("generated", 0.5, tmp_path / "kv", tmp_path / "out", force=False)
    return run_ruler(llm, list(tasks), (CONTEXT,), 1, list(modes), BudgetShares(), options)


def test_every_suite_mode_answers_every_family_and_offload_repeats_dense(tiny_llm, tmp_path, capsys, monkeypatch):
    path = _run(tiny_llm, tmp_path)
    cells = list(json.loads(path.read_text())["cells"].values())
    assert len(cells) == len(TASKS) * len(SUITE_MODES)
    assert {(cell["task"], cell["mode"]) for cell in cells} == {(task, mode) for task in TASKS for mode in SUITE_MODES}
    for cell in cells:
        assert 0.0 <= cell["score"] <= 1.0 and cell["token_ids"] and cell["prompt_tokens"] <= CONTEXT
        assert cell["kv"] == SUITE_MODES[cell["mode"]]["kv"] and cell["alpha"] == SUITE_MODES[cell["mode"]].get("alpha")
        assert cell["top_p"] == SUITE_MODES[cell["mode"]].get("top_p")
        assert (cell["attention_budget"] is not None) == (cell["kv"] == "sparse")
    by_mode = {(cell["task"], cell["mode"]): cell for cell in cells}
    for task in TASKS:
        assert by_mode[task, "offload"]["token_ids"] == by_mode[task, "dense"]["token_ids"]
        assert len({(cell["device_kv_budget"], cell["host_kv_budget"]) for cell in cells if cell["task"] == task}) == 1
        assert by_mode[task, "sparse-0.1"]["disk_bytes_read"] > 0  # the prompt lies mostly on disk
    err = capsys.readouterr().err
    assert err.count("[bench ruler] ") == len(cells) and "vt context=600 sample=0 quest: score" in err
    markdown = path.with_suffix(".md").read_text()
    assert "## Retention vs dense" in markdown and "| sparse-0.2 |" in markdown and "| quest |" in markdown
    assert "Exactness check: offload repeated dense's tokens on 3/3 samples." in markdown
    assert "## Cold reads and attention kept per family" in markdown and "| sparse-p0.9 | aggregation |" in markdown

    def must_not_run(*args, **kwargs):
        raise AssertionError("a finished cell ran again")

    monkeypatch.setattr(ruler_bench, "run_cell", must_not_run)
    monkeypatch.setattr(ruler_bench, "record_prompt", must_not_run)
    assert _run(tiny_llm, tmp_path) == path


def test_an_offload_answer_that_differs_from_dense_stops_the_run(tiny_llm, tmp_path, monkeypatch):
    run_cell = ruler_bench.run_cell

    def diverging(llm, cell, *args):
        result = run_cell(llm, cell, *args)
        return result | {"token_ids": result["token_ids"] + [0]} if cell.mode == "offload" else result

    monkeypatch.setattr(ruler_bench, "run_cell", diverging)
    with pytest.raises(ModesDiffer, match="offload must equal dense token for token"):
        _run(tiny_llm, tmp_path, modes=("dense", "offload", "quest"), tasks=["fwe"])
    cells = json.loads((tmp_path / "out" / f"ruler-{tiny_llm.name}.json").read_text())["cells"]
    assert sorted(cell["mode"] for cell in cells.values()) == ["dense", "offload"]  # kept, as evidence; quest not run


def test_an_answer_stops_at_its_cap_or_once_it_is_done(tiny_llm, monkeypatch):
    model = tiny_llm.model
    ids = torch.randint(2, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(model.generation_config, "eos_token_id", -1)  # a random model's greedy EOS: none here

    def tokens(**stop):
        with torch.inference_mode():
            cache = make_cache(model, KVConfig(), 60)
            return ruler_bench.greedy_tokens(tiny_llm, cache, model(input_ids=ids, cache=cache).logits[:, -1], **stop)

    assert len(tokens(limit=9)) == 9
    assert len(tokens(limit=9, done=lambda ids: len(ids) == 4)) == 4
