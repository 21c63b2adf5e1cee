"""RULER summaries: task means, family means, RULER's average, retention against dense on shared cells."""

import pytest

from kvtier.eval.accuracy.ruler_report import ALL, equality_checks, markdown, summary


def _cell(mode, task, seed, score, context=2048, tokens=(1, 2)):
    return {"mode": mode, "task": task, "context": context, "seed": seed, "score": score, "token_ids": list(tokens),
            "ms_per_token": 10.0, "disk_bytes_read": 4096}


CELLS = [
    _cell("dense", "niah_single_essay", 0, 1.0), _cell("dense", "niah_single_essay", 1, 1.0),
    _cell("dense", "niah_multikey", 0, 0.5), _cell("dense", "cwe", 0, 0.4), _cell("dense", "fwe", 0, 0.0),
    _cell("sparse-0.2", "niah_single_essay", 0, 1.0), _cell("sparse-0.2", "niah_single_essay", 1, 0.0),
    _cell("sparse-0.2", "niah_multikey", 0, 0.5), _cell("sparse-0.2", "cwe", 0, 0.2), _cell("sparse-0.2", "fwe", 0, 0.0),
    _cell("sparse-0.2", "vt", 0, 1.0),  # dense did not run it: in the scores, not in the retention
    _cell("offload", "cwe", 0, 0.4), _cell("offload", "fwe", 0, 0.0, tokens=(1, 3)),
]


def test_scores_are_means_of_tasks_and_retention_compares_the_same_cells():
    rows = summary(CELLS)
    assert list(rows) == ["dense", "offload", "sparse-0.2"]  # the suite's order
    sparse = rows["sparse-0.2"]
    assert sparse["tasks"] == {"niah_single_essay": 0.5, "niah_multikey": 0.5, "vt": 1.0, "cwe": 0.2, "fwe": 0.0}
    assert sparse["families"] == {"retrieval": 0.5, "multi-hop": 1.0, "aggregation": 0.1}
    assert sparse["average"] == pytest.approx(2.2 / 5)
    assert sparse["retention"]["retrieval"] == pytest.approx(1.5 / 2.5)
    assert sparse["retention"]["aggregation"] == pytest.approx(0.2 / 0.4)
    assert sparse["retention"]["multi-hop"] is None  # no shared cell
    assert sparse["retention"][ALL] == pytest.approx(1.7 / 2.9)
    assert rows["dense"]["retention"][ALL] == 1.0


def test_the_exactness_check_counts_samples_where_offload_repeated_dense():
    assert equality_checks(CELLS) == {"offload": (1, 2)}


def test_markdown_has_a_row_per_mode_in_each_table():
    text = markdown({"settings": {"model": "m", "corpus": {"name": "c", "license": "l", "source": "s"},
                                  "host_share": 0.4, "device_share": 0.02, "min_device_tokens": 128, "beta": "auto",
                                  "live_tokens": 32, "cache_bypass": "O_DIRECT"},
                     "cells": {str(i): cell for i, cell in enumerate(CELLS)}}, "ruler-m.png")
    assert "| sparse-0.2 | 0.600 | - | 0.500 | 0.586 |" in text
    assert "| sparse-0.2 | 50.0 | 100.0 | 10.0 | 44.0 |" in text
    assert "| vt | - | - | 100.0 |" in text
    assert "Exactness check: offload repeated dense's tokens on 1/2 samples." in text
    assert "![retention per task family](plots/ruler-m.png)" in text
