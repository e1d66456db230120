"""Byte sizes as people write them ("300M", "2GiB", "64K") and back."""
from __future__ import annotations

import re

from .errors import UserError

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "mb": 1 << 20,
          "g": 1 << 30, "gib": 1 << 30, "gb": 1 << 30, "t": 1 << 40, "tib": 1 << 40, "tb": 1 << 40}


def parse_size(text: str) -> int:
    """Binary units whatever the spelling: 1M = 1MB = 1MiB = 2**20 bytes, as llama.cpp and dd read them."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise UserError(f"cannot parse size {text!r} (examples: 4K, 64KiB, 300M, 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def human(n: int) -> str:
    """The shortest exact spelling: 16384 -> 16K, 1048576 -> 1M, 1000 -> 1000."""
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)
