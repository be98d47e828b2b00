"""Progress bars for long work: tqdm on a terminal, silent otherwise."""
from __future__ import annotations

import sys
from typing import Iterable, TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], desc: str, unit: str = "it", total: int | None = None,
             enabled: bool | None = None) -> Iterable[T]:
    """Wrap ``items`` in a tqdm bar when stderr is a terminal (or ``enabled`` is True)."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return items
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a dependency, but a bar is never worth a crash
        return items
    return tqdm(items, desc=desc, unit=unit, total=total, leave=False)
