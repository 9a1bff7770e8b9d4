"""Small helpers shared by every layer of the package (imports nothing from hybridkv)."""

from __future__ import annotations

import gc
import re

_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "M": 1000**2, "MB": 1000**2, "G": 1000**3, "GB": 1000**3,
          "T": 1000**4, "TB": 1000**4, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


def parse_bytes(text: str | int) -> int:
    """Parse '40GiB', '1.5 GB', '512MiB' or a plain int into bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if m is None or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot parse a byte size from {text!r} (examples: 40GiB, 512MiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_bytes(n: float) -> str:
    """Human-readable binary size: 1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def freeze_startup_heap() -> int:
    """Collect once, then set every object alive now aside from the cyclic garbage collector (``gc.freeze``); the
    number set aside. For a long-running server process, once it has started: its imports and start-up (~200k
    objects with torch) would otherwise be traversed by every full collection, a pause of tens of milliseconds in
    the middle of a step or of a stream's chunks. Objects made later are collected as before; a set-aside object
    is still freed when its last reference goes, but one dropped inside a cycle is never collected, with whatever
    newer objects the cycle holds (a server drops few of its start-up objects)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
