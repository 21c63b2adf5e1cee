"""Fixtures for the baseline KV modes: tiny random models, single-threaded torch (selective_fixtures.py),
helpers in baseline_runs.py."""

import sys
from pathlib import Path

from selective_fixtures import one_torch_thread, tiny_gemma3, tiny_llama  # noqa: F401  (pytest fixtures)

sys.path.insert(0, str(Path(__file__).parent))  # baseline_runs, under pytest's importlib mode
