"""Sizes in messages, in the unit that shows them: ``2.3 MiB``, not ``0.00 GiB``."""

from __future__ import annotations

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def readable_bytes(n: float) -> str:
    """``n`` bytes with three significant digits in the largest binary unit below it."""
    for unit in _UNITS[:-1]:
        if abs(n) < 1024:
            return f"{n:.3g} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.3g} {_UNITS[-1]}"
