"""smollm2-135m: with alpha = 1 the sparse path generates exactly what the dense cache does."""

import pytest

from kvtier.generation import generate
from kvtier.modes import KVConfig

pytestmark = pytest.mark.model

PROMPT = ("Read the notes and answer.\n" + " ".join(
    f"Note {i}: the locker of employee {i} is number {1000 + 7 * i}." for i in range(40))
    + "\nWhat is the locker number of employee 17?")


@pytest.fixture(scope="module")
def llm():
    from kvtier.models.loader import load_model

    return load_model("smollm2-135m")


def test_alpha_one_generates_what_dense_generates(llm, tmp_path):
    dense = generate(llm, PROMPT, max_new_tokens=12, progress=False)
    sparse_config = KVConfig(kv="sparse", alpha=1.0, beta="0.5", host_kv_budget="4MiB", storage_dir=str(tmp_path))
    sparse = generate(llm, PROMPT, max_new_tokens=12, kv_config=sparse_config, progress=False)
    assert sparse.token_ids == dense.token_ids
    assert sparse.kv_bytes["storage"] > sparse.kv_bytes["host"] > 0
    assert sparse.disk_bytes_read > 0 and sparse.disk_bytes_written > 0

