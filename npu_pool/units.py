"""Byte and share formatting shared by messages, the text and the HTML reports (imports nothing)."""
from __future__ import annotations

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def fmt_bytes(n: float) -> str:
    """``1536 -> '1.50 KiB'``; negative values keep their sign."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in _UNITS:
        if n < 1024 or unit == _UNITS[-1]:
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_share(part: float, whole: float) -> str:
    """``part`` as a percentage of ``whole`` (``'-'`` when ``whole`` is 0)."""
    return f"{100.0 * part / whole:.1f}%" if whole else "-"
