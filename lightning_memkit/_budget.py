"""A memory budget given the ways users say it: ``8_000_000_000``, ``"24GB"``, ``"6 GiB"``."""

from __future__ import annotations

import re

__all__ = ["parse_bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$")


def parse_bytes(value: int | str) -> int:
    """Bytes from an int or a string with a decimal (GB) or binary (GiB) unit, any case.

    >>> parse_bytes("24GB"), parse_bytes("1.5 GiB"), parse_bytes(1024)
    (24000000000, 1610612736, 1024)
    """
    if isinstance(value, bool):
        raise TypeError(f"A memory size must be bytes or a string like '24GiB', got {value!r}")
    if isinstance(value, int):
        number, unit = value, ""
    elif isinstance(value, str):
        match = _PATTERN.match(value.lower())
        if match is None or match.group(2) not in _UNITS:
            raise ValueError(
                f"Cannot read {value!r} as a memory size: use bytes or a number with one of the units "
                f"{', '.join(u for u in _UNITS if u)} (e.g. '24GB', '6GiB')."
            )
        number, unit = float(match.group(1)), match.group(2)
    else:
        raise TypeError(f"A memory size must be bytes or a string like '24GiB', got {type(value).__name__}")
    nbytes = int(number * _UNITS[unit])
    if nbytes <= 0:
        raise ValueError(f"A memory size must be positive, got {value!r}")
    return nbytes
