"""Byte counts as people write and read them: '80GiB', '1.5GB' in, '1.34 GB (1.25 GiB)' out."""

from __future__ import annotations

from kvpool.errors import InvalidArgument

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
    "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """'80GiB' -> 85899345920, '1.5GB' -> 1500000000, '4096' -> 4096."""
    s = text.strip().lower().replace("_", "").replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    if unit not in _UNITS or not num:
        raise InvalidArgument(
            f"cannot read {text!r} as a size; use e.g. 80GiB, 512MiB, 1.5GB or a byte count"
        )
    try:
        value = float(num) * _UNITS[unit]
    except ValueError:
        raise InvalidArgument(f"cannot read {text!r} as a size") from None
    if value < 0:
        raise InvalidArgument(f"size must be >= 0, got {text!r}")
    return int(value)


_DEC = ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB"))
_BIN = ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))


def format_bytes(n: float) -> str:
    """Decimal and binary units side by side: '1.34 GB (1.25 GiB)'."""
    if n < 1000:
        return f"{int(n)} B"
    dscale, dunit = next(u for u in _DEC if n >= u[0])
    bscale, bunit = next((u for u in _BIN if n >= u[0]), _BIN[-1])
    return f"{n / dscale:.2f} {dunit} ({n / bscale:.2f} {bunit})"
