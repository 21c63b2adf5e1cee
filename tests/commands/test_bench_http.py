"""`kvtier bench http` end to end on a tiny local model: every (backend, clients) cell is measured and written.

Mechanics only: no assertion here is about speed.
"""

import json
import statistics

from kvtier.cli import main


def test_writes_a_cell_per_backend_and_client_count(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    rc = main(["bench", "http", "--model", str(tiny_model_dir), "--clients", "1,4", "--repeats", "2",
               "--new-tokens", "20", "--min-requests", "2", "--device-blocks", "3", "--swap-space", "4MiB",
               "--flash-dir", str(tmp_path / "flash"), "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "http.json").read_text())
    cells = {(cell["backend"], cell["clients"]): cell for cell in result["cells"]}
    assert set(cells) == {(backend, clients) for backend in ("flash", "dram") for clients in (1, 4)}
    assert result["requests"] == {"1": 2, "4": 4}
    for cell in cells.values():
        assert len(cell["runs"]) == 2
        ratios = [run["ratio"] for run in cell["runs"]]
        assert cell["ratio"] == statistics.median(ratios) and cell["ratio_spread"] == [min(ratios), max(ratios)]
        assert 0 < cell["ttft_p50_s"] <= cell["ttft_p99_s"] and 0 < cell["itl_p50_s"] <= cell["itl_p99_s"]
    assert cells[("flash", 4)]["swap_outs"] > 0  # three blocks of 16 tokens cannot hold four growing sequences
    markdown = (out / "http.md").read_text()
    assert "## flash swap" in markdown and "## dram swap" in markdown and "| 4 |" in markdown
