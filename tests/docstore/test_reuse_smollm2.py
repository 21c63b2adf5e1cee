"""Real-model claim: a question asked of a stored 4K-token document answers token for token as a cold run,
in every KV mode (smollm2-135m)."""

import pytest

import kvtier
from kvtier.data.corpus import generate_text
from kvtier.generation import generate
from kvtier.modes import KVConfig
from kvtier.sparse.cache import SparseCache
from kvtier.sparse.cold.cold_pool import ColdPool
from kvtier.sparse.settings import SparseSettings
from kvtier.docstore import DocumentStore

pytestmark = pytest.mark.model
NEW_TOKENS = 12
QUESTION = "\n\nName one place mentioned in the text."


@pytest.fixture(scope="module")
def smollm2():
    return kvtier.load_model("smollm2-135m")


@pytest.fixture(scope="module")
def document(smollm2):
    text = generate_text(20_000, seed=5)
    assert kvtier.prompt_ids(smollm2, text).shape[1] >= 4000
    return text


@pytest.fixture(scope="module")
def store(smollm2, document, tmp_path_factory):
    """The document stored by a first question."""
    store = DocumentStore(tmp_path_factory.mktemp("store"))
    first = generate(smollm2, document + "\n\nWhat is the text about?", NEW_TOKENS, progress=False, kv_store=store)
    assert first.reused_prompt_tokens == 0 and len(store.entries()) == 1
    return store


@pytest.fixture(scope="module")
def cold_dense(smollm2, document):
    return generate(smollm2, document + QUESTION, NEW_TOKENS, progress=False)


def tiered(mode: str, storage_dir) -> KVConfig:
    return KVConfig(kv=mode, device_kv_budget="8MiB", host_kv_budget="48MiB", storage_dir=str(storage_dir))


@pytest.fixture(scope="module")
def cold_sparse(smollm2, document, tmp_path_factory):
    return generate(smollm2, document + QUESTION, NEW_TOKENS, tiered("sparse", tmp_path_factory.mktemp("kv")),
                    progress=False)


@pytest.mark.parametrize("mode", ["dense", "offload", "sparse"])
def test_a_second_question_equals_a_cold_run(smollm2, document, store, cold_dense, cold_sparse, tmp_path, mode):
    config = KVConfig(kv=mode) if mode == "dense" else tiered(mode, tmp_path)
    # offload is exact (tests/test_generation.py): its cold run is the dense one; sparse selects, so it gets its own
    cold = cold_sparse if mode == "sparse" else cold_dense
    warm = generate(smollm2, document + QUESTION, NEW_TOKENS, config, progress=False, kv_store=store)
    assert warm.reused_prompt_tokens >= cold.prefill_tokens - 256 - 16
    assert warm.token_ids == cold.token_ids
    if mode == "offload":
        assert warm.disk_bytes_written == 0  # its disk tier is the stored prefix, read in place


def test_a_document_stored_by_the_sparse_path_is_reused_in_place(smollm2, document, cold_sparse, tmp_path,
                                                                 monkeypatch):
    """The first question stores the placed cold pool with the document; the second adopts it, writes none of the
    document's tokens while its prompt is placed, and answers as the cold run."""
    config = tiered("sparse", tmp_path)
    store = DocumentStore(tmp_path / "store")
    first = generate(smollm2, document + "\n\nWhat is the text about?", NEW_TOKENS, config, progress=False,
                     kv_store=store)
    adopted, appended = [], []
    monkeypatch.setattr(ColdPool, "adopt", lambda pool, layer, positions, adopt=ColdPool.adopt: (
        adopted.append(len(positions)), adopt(pool, layer, positions)))
    monkeypatch.setattr(ColdPool, "append", lambda pool, layer, keys, values, positions, append=ColdPool.append: (
        appended.append(positions.min()), append(pool, layer, keys, values, positions)))
    marks = []  # appended[marks[0]:marks[1]]: the placement's (later ones are the decode's demotions)
    monkeypatch.setattr(SparseCache, "place_prompt", lambda cache, place=SparseCache.place_prompt: (
        marks.append(len(appended)), place(cache), marks.append(len(appended))))
    warm = generate(smollm2, document + QUESTION, NEW_TOKENS, config, progress=False, kv_store=store)
    assert warm.token_ids == cold_sparse.token_ids and warm.reused_prompt_tokens >= warm.prefill_tokens - 256 - 16
    assert len(adopted) == 30 and min(adopted) > 1000  # every layer's cold pool is the stored one
    # None of the document the first question pooled is written again; the stored tokens that were still in its
    # recent window (up to recent + retire_batch of them) are placed as a cold run would.
    imaged = first.prefill_tokens - SparseSettings().recent - SparseSettings().retire_batch
    assert all(position >= imaged for position in appended[marks[0] : marks[1]])
