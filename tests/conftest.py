"""Shared test set-up: make tests/ importable (tiny_models) under pytest's importlib mode."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
