"""Where kvtier keeps its per-user files: KV files, the document store, calibrations, corpus texts, and
what it derives from models (assembled GGUFs, hash stamps, safetensors copies).

The root is `$KVTIER_CACHE_DIR`, else `$XDG_CACHE_HOME/kvtier`, else `~/.cache/kvtier`.
Nothing here creates directories; writers create what they need.

Writers build a file or directory under a partial name and rename it into place, so a reader
never sees half of one. The partial name carries the writer's pid: a writer that was killed
(no `finally` runs on SIGKILL or SIGTERM) leaves hundreds of MB behind, which the next writer
of the same thing removes once that pid is gone.
"""

import os
import shutil
from pathlib import Path

from kvtier.processes import process_exists


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


def partial_path(final: Path) -> Path:
    """Where this process builds `final` before renaming it into place."""
    return final.with_name(f".{final.name}.partial-{os.getpid()}")


def remove_abandoned_partials(final: Path) -> None:
    """Delete partial copies of `final` whose writer process no longer exists."""
    if not final.parent.is_dir():
        return
    for partial in final.parent.glob(f".{final.name}.partial-*"):
        pid = partial.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not process_exists(int(pid)):
            if partial.is_dir():
                shutil.rmtree(partial, ignore_errors=True)
            else:
                partial.unlink(missing_ok=True)

