"""Where kvtier keeps files it derives from models: assembled GGUFs, hash stamps, safetensors copies.

The root is `$KVTIER_CACHE_DIR`, else `$XDG_CACHE_HOME/kvtier`, else `~/.cache/kvtier`.
Nothing here creates directories; writers create what they need.
"""

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of kvtier's per-user cache."""
    explicit = os.environ.get("KVTIER_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "kvtier"
    return Path.home() / ".cache" / "kvtier"


def assembled_dir() -> Path:
    """GGUF files concatenated from multi-part packages."""
    return cache_dir() / "models"


def stamps_dir() -> Path:
    """Verified-hash stamps, one JSON file per hashed file (see install.py)."""
    return cache_dir() / "stamps"


def converted_dir() -> Path:
    """Safetensors copies of GGUF models, one directory per GGUF sha256."""
    return cache_dir() / "converted"
