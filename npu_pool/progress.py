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


class ByteProgress:
    """A bar over ``total`` bytes of long reading, or other ``unit``\ s of long work (``total`` None: a
    count that moves, where the end is not known; a terminal only, as :func:`progress`): ``to(n)``
    moves it to ``n`` done; ``close()`` takes it off the screen. Silent where no bar shows."""

    def __init__(self, desc: str, total: int | None, enabled: bool | None = None, unit: str = "B") -> None:
        self._bar = None
        if enabled is None:
            enabled = sys.stderr.isatty()
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self._bar = tqdm(desc=desc, total=total, unit=unit, unit_scale=True, leave=False,
                             unit_divisor=1024 if unit == "B" else 1000)

    def to(self, done: int) -> None:
        if self._bar is not None and done > self._bar.n:
            self._bar.update(done - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
