"""Byte, share and text formatting shared by messages, the text and the HTML reports (imports nothing of the package)."""
from __future__ import annotations

import re
from typing import Iterable

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


def name_width(names: Iterable[str], least: int = 25) -> int:
    """The width of a table's name column: ``least``, or the longest name's (never cut: the two
    devices of one snapshot, ``run.dev0`` and ``run.dev1``, cut alike could not be told apart)."""
    return max([least, *map(len, names)])


def printable(text: str) -> str:
    """``text`` safe to print to a terminal: control characters (ESC, CR, newlines: a file's strings
    could retitle a terminal or forge a line), bidirectional overrides and isolates (they reorder
    what follows them on the line, as in "Trojan Source") and lone surrogates written as escapes."""
    out = []
    for ch in text:
        o = ord(ch)
        if o < 0x20 or 0x7F <= o < 0xA0 or 0xD800 <= o < 0xE000 or 0x202A <= o <= 0x202E or 0x2066 <= o <= 0x2069:
            out.append(f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}")
        else:
            out.append(ch)
    return "".join(out)


_TAG = re.compile(r"<(?=[A-Za-z/!?])")  # a "<" that can open an HTML tag (not the " < " between frames)


def md_cell(text: str) -> str:
    """:func:`printable` ``text`` for a Markdown table cell or line: ``|`` escaped, a ``<`` that
    could open an HTML tag as ``&lt;`` (a renderer that passes HTML through would run a
    ``<script>``)."""
    return _TAG.sub("&lt;", printable(text).replace("|", "\\|"))
