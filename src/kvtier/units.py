"""Human-readable quantities: parse byte sizes (`256MiB`, `1GiB`, `4096`) and format them back; counts with their
noun (`1 entry`, `2 entries`)."""

import re

from kvtier.errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes from `text`: a plain integer or a number with a unit (KiB, MiB, GiB, TiB, KB, MB, GB, TB)."""
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"size must not be negative: {text}")
        return text
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(f"cannot parse size {text!r}: use a number with an optional unit, e.g. 256MiB or 1GiB")
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(num_bytes: int) -> str:
    """`num_bytes` in the largest binary unit that keeps the number >= 1."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return f"{value:.1f}TiB"


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """`count` and `noun` in the number it takes: `1 token`, `2 tokens`, `0 entries` (`plural` when not noun + s)."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"
