"""Real-model claim of the accuracy harness: the sparse (HillInfer) path keeps a needle that dense finds.

One needle cell of 512 document tokens of real text through smollm2-135m with most of the
prompt's KV off the device (host 40%, the rest on disk); the needle sits mid-document, far
from the always-kept sink and recent tokens, so the scorer must select it.
"""

import pytest

import kvtier
from kvtier.data.corpus import load_corpus
from kvtier.eval.accuracy.budgets import BudgetShares, cell_kv_config
from kvtier.eval.accuracy.needle_grid import needle_cell

pytestmark = pytest.mark.model


def test_sparse_finds_a_single_needle_in_real_text(tmp_path):
    llm = kvtier.load_model("smollm2-135m")
    corpus = load_corpus("auto", min_chars=20_000, progress=False)
    # A fixed beta: the calibration behind beta=auto is cached per storage dir and would run for every tmp dir.
    config = cell_kv_config("sparse", llm.model, 512, BudgetShares(), storage_dir=str(tmp_path), beta=0.5)
    cell = needle_cell(llm, config, 512, 0.5, "single", 0, corpus.text)
    assert cell["correct"], cell["answer"]
    assert cell["disk_bytes_read"] > 0  # the scorer read the cold pool's sketches from disk
    assert not list(tmp_path.iterdir())
