"""Source code as a corpus: the Python standard library's own modules, read at run time from the interpreter.

Nothing is copied into the repository: the text is the `.py` files of the running interpreter's standard library
(PSF licence), top level only, in sorted name order, each preceded by a `# file: <name>` line, until enough
characters are had. The same interpreter gives the same text; another Python version gives other code of the same
kind, which is what a corpus of source code is for.
"""

import sys
import sysconfig
from pathlib import Path

LICENSE = "PSF-2.0 (the Python standard library)"


def stdlib_directory() -> Path:
    """The directory of the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def source() -> str:
    """Where the text comes from, for result files."""
    return f"Python {sys.version.split()[0]} standard library sources ({stdlib_directory()})"


def stdlib_code(min_chars: int, directory: Path | None = None) -> str:
    """At least `min_chars` characters of Python source from `directory` (default: the standard library's), or all
    of it when it holds fewer (the caller checks the length); a longer request extends a shorter one."""
    pieces: list[str] = []
    length = 0
    for path in sorted((directory or stdlib_directory()).glob("*.py")):
        if length >= min_chars:
            break
        try:
            code = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):  # an unreadable module is skipped, the next one serves
            continue
        piece = f"# file: {path.name}\n{code.strip()}\n"
        pieces.append(piece)
        length += len(piece) + 1
    return "\n".join(pieces)
