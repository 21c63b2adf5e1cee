"""One smollm2-135m load per session for the server tests (tests/http_server.py starts servers on it)."""

import pytest

from http_server import MODEL


@pytest.fixture(scope="session")
def llm():
    from kvtier.models.loader import load_model

    return load_model(MODEL)


@pytest.fixture(scope="session")
def reference_llm():
    """A second instance for references computed while a server runs (the engine owns `llm`'s attention)."""
    from kvtier.models.loader import load_model

    return load_model(MODEL)


@pytest.fixture(scope="module")
def paged_server(llm, tmp_path_factory):
    """A server of this module's own on `llm`: paged requests only (64 blocks of 16 tokens), no key."""
    from http_server import running_server

    with running_server(llm, tmp_path_factory.mktemp("server"), device_blocks=64, swap="recompute") as served:
        yield served


@pytest.fixture(scope="module")
def client(paged_server):
    """The real `openai` client on `paged_server`."""
    import openai

    return openai.OpenAI(base_url=paged_server[0].url + "/v1", api_key="none", max_retries=0)
