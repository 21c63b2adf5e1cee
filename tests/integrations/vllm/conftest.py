"""vLLM's real offloading classes for the tier's contract tests.

These tests are part of `make test`, which installs vLLM (the Makefile's `vllm` step); where vLLM
cannot be imported they fail with the reason instead of being skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvtier.integrations.vllm.config import tiering_manager
from vllm_chunks import SMOLLM2_BLOCK, vllm_api


@pytest.fixture(scope="session")
def vllm() -> Any:
    """vLLM's offloading modules, or a failure naming why they cannot be imported."""
    try:
        return vllm_api()
    except Exception as error:  # ImportError, or a broken dependency of vLLM's
        pytest.fail(f"vLLM 0.33 is not importable ({type(error).__name__}: {error}); run `make vllm`")


@pytest.fixture
def make_manager(vllm: Any) -> Iterator[Callable[..., Any]]:
    """Build vLLM's TieringOffloadingManager from a config (as the connector does); shut down at the end."""
    managers = []

    def make(tiers: list[dict[str, Any]], block_bytes: int = SMOLLM2_BLOCK, cpu_chunks: int = 64, **kw: Any) -> Any:
        manager = tiering_manager(block_bytes, cpu_chunks, tiers, **kw)
        managers.append(manager)
        return manager

    yield make
    for manager in managers:
        manager.shutdown()
