"""Result files of the evaluation suite: one JSON file per experiment, one entry per finished cell.

Every file records the machine it ran on (cores, memory, the storage dir's disk),
the software versions and the run's settings, so a number is never read without
its context. Cells are keyed by their parameters; a re-run skips finished cells
(`--force` reruns them), so an interrupted grid resumes where it stopped. A file
whose cells were run with other settings is never silently replaced: that is an error
naming the differences, unless `--force`.
Writes are atomic (temp file + rename): an interrupted run never leaves half a file.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
from importlib import metadata
from pathlib import Path
from typing import Any

from kvtier.errors import StorageError
from kvtier.storage import open_direct


def cell_key(**params: Any) -> str:
    """A stable key for one cell of a grid, e.g. `context=2048,depth=0.5,mode=sparse`."""
    return ",".join(f"{name}={params[name]}" for name in sorted(params))


def spread(values: list[float]) -> dict[str, float]:
    """Median with min, max and count: the form every repeated measurement is reported in."""
    if not values:
        raise ValueError("spread of no values")
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def machine_info(storage_dir: str | Path | None = None) -> dict[str, Any]:
    """Cores, memory, disk of `storage_dir`, and versions: what a reader needs to compare numbers."""
    info: dict[str, Any] = {
        "cpu_cores": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_bytes": _memory_bytes(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {name: _version(name) for name in ("kvtier", "torch", "transformers", "numpy")},
    }
    if storage_dir is not None:
        info["disk"] = disk_info(Path(storage_dir))
    return info


def accepts_direct_io(directory: Path) -> bool:
    """Whether files in `directory` open with O_DIRECT (a filesystem such as tmpfs refuses it)."""
    probe = directory / f".kvtier-direct-probe-{os.getpid()}"
    fd, direct = open_direct(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    os.close(fd)
    probe.unlink()
    return direct


def disk_info(path: Path) -> dict[str, Any]:
    """Filesystem type, device and whether it spins, for the filesystem holding `path`."""
    mount, fstype, device = _mount_of(path.resolve())
    return {"path": str(path), "mount": mount, "fstype": fstype, "device": device, "rotational": _rotational(device)}


class ResultStore:
    """The JSON file of one experiment: header (machine, settings) plus finished cells."""

    def __init__(self, path: Path, settings: dict[str, Any], storage_dir: str | Path | None = None,
                 force: bool = False) -> None:
        self.path = path
        existing = {} if force else _read(path)
        if existing.get("cells") and existing.get("settings") != settings:
            raise StorageError(f"{path} holds {len(existing['cells'])} finished cells run with other settings "
                               f"({_differences(existing.get('settings') or {}, settings)}); rerun with --force to "
                               "replace them, or pass another --out to keep both")
        self.data = {"experiment": path.stem, "settings": settings, "machine": machine_info(storage_dir),
                     "cells": existing.get("cells", {})}

    def done(self, key: str) -> bool:
        return key in self.data["cells"]

    def get(self, key: str) -> dict[str, Any]:
        return self.data["cells"][key]

    def put(self, key: str, result: dict[str, Any]) -> None:
        """Record a finished cell and save the file at once (so an interrupted grid keeps it)."""
        self.data["cells"][key] = result
        self.save()

    def cells(self) -> dict[str, dict[str, Any]]:
        return dict(self.data["cells"])

    def save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(f".{self.path.name}.partial-{os.getpid()}")
            partial.write_text(json.dumps(self.data, indent=1, sort_keys=True, allow_nan=False))  # strict JSON
            os.replace(partial, self.path)
        except OSError as error:
            raise StorageError(f"cannot write results to {self.path}: {error.strerror or error}") from None


def _read(path: Path) -> dict[str, Any]:
    """A previous run's file, or {} when there is none; a corrupt one is an error, never silently dropped."""
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise StorageError(f"results file {path} is unreadable ({error}); move it away or rerun with --force") from None


def _differences(before: dict[str, Any], now: dict[str, Any]) -> str:
    """`name: X there, Y now` for each setting that differs (None where one side lacks it)."""
    names = sorted(name for name in before.keys() | now.keys() if before.get(name) != now.get(name))
    return "; ".join(f"{name}: {before.get(name)!r} there, {now.get(name)!r} now" for name in names)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _mount_of(path: Path) -> tuple[str | None, str | None, str | None]:
    """(mount point, fs type, device) of the longest /proc/mounts entry containing `path`."""
    best: tuple[str | None, str | None, str | None] = (None, None, None)
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        device, mount, fstype = fields[0], fields[1], fields[2]
        if (str(path) == mount or str(path).startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best[0] or ""):
            best = (mount, fstype, device)
    return best


def _rotational(device: str | None) -> bool | None:
    """True for a spinning disk, False for flash, None when the kernel does not say (e.g. overlay, tmpfs)."""
    if not device or not device.startswith("/dev/"):
        return None
    name = Path(device).name
    for candidate in (name, name.rstrip("0123456789"), name.split("p")[0] if name.startswith("nvme") else name):
        flag = Path(f"/sys/block/{candidate}/queue/rotational")
        if flag.exists():
            return flag.read_text().strip() == "1"
    return None
