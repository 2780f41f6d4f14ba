"""Human byte sizes for the CLI and configs: "4GiB", "512MiB", "1.5G", "1000" (bytes)."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1 << 10,
    "kib": 1 << 10,
    "mi": 1 << 20,
    "mib": 1 << 20,
    "gi": 1 << 30,
    "gib": 1 << 30,
    "ti": 1 << 40,
    "tib": 1 << 40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes in `text`; SI units are powers of 1000, IEC units (KiB, MiB, GiB, TiB) powers of 1024."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be non-negative, got {text}")
        return text
    match = _PATTERN.match(text)
    if match is None:
        raise ValueError(f"cannot parse size {text!r}; expected e.g. '4GiB', '512MiB', '1000'")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"unknown size unit {unit!r} in {text!r}; use B, KiB, MiB, GiB, TiB (or KB, MB, GB, TB)")
    return int(float(number) * factor)


def format_size(nbytes: int) -> str:
    """The largest IEC unit that keeps the number >= 1, e.g. 1536 -> '1.5KiB'."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.4g}{unit}"
        value /= 1024
    return f"{value:.4g}TiB"
