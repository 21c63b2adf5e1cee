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
