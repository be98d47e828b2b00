"""The plan: per position of an iteration, its size, offset and lifetime, over one region."""
from __future__ import annotations

import array
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..vocab import ROUND
from .lifetimes import NONE

__all__ = ["ALIGN", "NONE", "ONLINE", "Plan", "PlanError", "aligned", "paired", "span"]

ALIGN = ROUND  # the core's block granularity: planned sizes round up to it, offsets are multiples of it


ONLINE = "online"  # plan.meta key: why the plan runs online (absent: the plan is used; see check.py)


class PlanError(ValueError):
    """A plan file or plan is malformed or inconsistent; the message says where and why."""


@dataclass
class Plan:
    """Position p asks for ``size[p]`` bytes and gets ``offset[p]`` in a region of ``region``
    bytes; it is live for positions [p, end[p]). Positions [0, loop) are a prologue run once,
    [loop, n) the loop body, which repeats: a body position's end past n wraps into the next
    pass (to loop + end - n). Unplanned positions have offset and end NONE. ``flags`` bit 0:
    each iteration's first allocation follows MARK_ITER_BEGIN; bit 1: position 0 is the first
    request after installation; bit 2: body positions held for good (end = p + body) were made
    once, in the first pass (later passes skip them). ``meta`` (JSON) describes where the plan came from."""

    size: array.array
    offset: array.array
    end: array.array
    region: int
    loop: int = 0
    flags: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.size)

    @property
    def planned(self) -> int:
        """Positions with an offset."""
        return sum(o != NONE for o in self.offset)

    @property
    def outside(self) -> int:
        """Bytes the planner found live outside the plan at once (``meta["outside_peak_bytes"]``:
        requests it leaves out and tensors live before its window, which the fallback serves); the
        planned policy maps them with its region. 0 where the meta holds no such whole number (it
        only spares device calls later)."""
        v = self.meta.get("outside_peak_bytes")
        return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 64 else 0

    def span(self, p: int, paired: int | None = None) -> tuple[int, int, int, int]:
        """Live positions of p: [lo, hi) and [lo2, hi2) (empty unless it wraps); ``paired``: as :func:`span`."""
        return span(self.n, self.loop, p, self.end[p], paired)


def span(n: int, loop: int, p: int, end: int, paired: int | None = None) -> tuple[int, int, int, int]:
    """Live positions of a request at p freed at end (NONE: until n): [lo, hi) and [lo2, hi2).
    ``paired``: the prologue position whose tensor a wrapping p stands for (:func:`paired`): the
    two are one rectangle, its wrapped range beginning there."""
    if end == NONE or end <= n:
        return p, n if end == NONE else end, 0, 0
    return p, n, loop if paired is None else paired, loop + end - n


def paired(n: int, loop: int, size: Sequence[int], offset: Sequence[int], end: Sequence[int]) -> dict[int, int]:
    """Prologue positions whose range a wrapping body position holds in the passes after the
    first, q -> p: one offset, one size, and p's previous instance freed where q is (a plan of a
    whole recorded step: the body request stands for the prologue's tensor in the step made
    again). Placed as one rectangle, live at [p, n) and [q, end[q])."""
    wrapping: dict[tuple[int, int, int], int] = {}
    for p in range(loop, n):
        if offset[p] != NONE and end[p] != NONE and end[p] > n:
            wrapping[(offset[p], aligned(size[p]), loop + end[p] - n)] = p
    out = {}
    for q in range(loop):
        if offset[q] != NONE and end[q] != NONE and loop < end[q] <= n:
            p = wrapping.pop((offset[q], aligned(size[q]), end[q]), None)
            if p is not None:
                out[q] = p
    return out


def aligned(size: int) -> int:
    """Bytes a request of ``size`` takes in the region."""
    return -(-size // ALIGN) * ALIGN
