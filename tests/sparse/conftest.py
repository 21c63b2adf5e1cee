"""Fixtures for the sparse path: tiny random models and single-threaded torch (see selective_fixtures.py)."""

from selective_fixtures import one_torch_thread, tiny_gemma3, tiny_llama  # noqa: F401  (pytest fixtures)
