"""Verification: no two time-overlapping rectangles of a plan share a byte.

A sweep over positions keeps the live rectangles ordered by offset; each rectangle
that starts is checked against its neighbours there. O(n log n) (plus list moves).
It is independent of the placement kernel: plain Python over the plan's numbers.
"""
from __future__ import annotations

import array
from bisect import bisect_left, bisect_right
from typing import Callable, Sequence

from .plan import ALIGN, NONE, Plan, PlanError, aligned, paired

__all__ = ["verify", "verify_rects"]


class _Live:
    """The live rectangles by offset: a list of sorted chunks (inserts cost O(sqrt n), not O(n))."""

    CHUNK = 512

    def __init__(self) -> None:
        self.offs: list[list[int]] = []   # chunks of offsets, ascending across chunks
        self.ids: list[list[int]] = []
        self.firsts: list[int] = []       # first offset of each chunk

    def _chunk(self, off: int) -> int:
        return max(0, bisect_right(self.firsts, off) - 1)

    def neighbours(self, off: int) -> tuple[int, int]:
        """Ids of the live rectangles just below and at/above ``off`` (-1: none)."""
        if not self.offs:
            return -1, -1
        c = self._chunk(off)
        offs, ids = self.offs[c], self.ids[c]
        i = bisect_left(offs, off)
        below = ids[i - 1] if i else (self.ids[c - 1][-1] if c else -1)
        above = ids[i] if i < len(offs) else (self.ids[c + 1][0] if c + 1 < len(self.offs) else -1)
        return below, above

    def add(self, off: int, r: int) -> None:
        if not self.offs:
            self.offs, self.ids, self.firsts = [[off]], [[r]], [off]
            return
        c = self._chunk(off)
        offs, ids = self.offs[c], self.ids[c]
        i = bisect_left(offs, off)
        offs.insert(i, off)
        ids.insert(i, r)
        self.firsts[c] = offs[0]
        if len(offs) > 2 * self.CHUNK:
            self.offs[c + 1:c + 1] = [offs[self.CHUNK:]]
            self.ids[c + 1:c + 1] = [ids[self.CHUNK:]]
            self.firsts.insert(c + 1, offs[self.CHUNK])
            del offs[self.CHUNK:], ids[self.CHUNK:]

    def remove(self, off: int, r: int) -> None:
        c = self._chunk(off)
        offs, ids = self.offs[c], self.ids[c]
        i = bisect_left(offs, off)
        while ids[i] != r:
            i += 1
        del offs[i], ids[i]
        if offs:
            self.firsts[c] = offs[0]
        else:
            del self.offs[c], self.ids[c], self.firsts[c]


def _by_position(n_pos: int, span: Sequence[int], n_spans: int, end: int) -> tuple[array.array, array.array]:
    """The non-empty spans e < n_spans grouped by their start (``end`` 0) or stop (1) position, in e's order
    within a position (a counting sort, in arrays: a plan of millions of positions kept a Python
    list per position, 12 times the file's size): those at position p are
    ``order[first[p]:first[p + 1]]``."""
    first = array.array("q", [0]) * (n_pos + 2)
    spans = range(n_spans)
    for e in spans:
        if span[2 * e] < span[2 * e + 1]:
            first[span[2 * e + end] + 1] += 1
    for p in range(n_pos + 1):
        first[p + 1] += first[p]
    order = array.array("q", [0]) * first[n_pos + 1]
    fill = array.array("q", first)
    for e in spans:
        if span[2 * e] < span[2 * e + 1]:
            at = span[2 * e + end]
            order[fill[at]] = e
            fill[at] += 1
    return first, order


def verify_rects(n_pos: int, offset: Sequence[int], size: Sequence[int], span: Sequence[int], region: int,
                 name: Callable[[int], str] = lambda r: f"rectangle {r}") -> None:
    """Raise PlanError unless every rectangle r -- ``size[r]`` bytes at ``offset[r]``, live at
    positions [span[4r], span[4r+1]) and [span[4r+2], span[4r+3]) -- fits in ``region`` and no
    two live at the same position overlap. ``name(r)`` labels a rectangle in messages."""
    for r in range(len(size)):
        if offset[r] + size[r] > region:
            raise PlanError(f"plan: {name(r)} at offset {offset[r]} (+{size[r]} bytes) runs past the region "
                            f"of {region} bytes")
        for lo, hi in ((span[4 * r], span[4 * r + 1]), (span[4 * r + 2], span[4 * r + 3])):
            if not 0 <= lo <= hi <= n_pos:
                raise PlanError(f"plan: {name(r)} is live at positions [{lo}, {hi}) outside 0..{n_pos}")
    # span e (= 2r + k, k = 0, 1: [span[2e], span[2e+1])) starts and stops, grouped by position
    first_start, starts = _by_position(n_pos, span, 2 * len(size), 0)
    first_stop, stops = _by_position(n_pos, span, 2 * len(size), 1)
    live = _Live()
    for pos in range(n_pos + 1):
        for e in stops[first_stop[pos]:first_stop[pos + 1]]:
            r = e >> 1
            live.remove(offset[r], r)
        for e in starts[first_start[pos]:first_start[pos + 1]]:
            r = e >> 1
            lo = offset[r]
            hi = lo + size[r]
            below, above = live.neighbours(lo)
            clash = below if below >= 0 and offset[below] + size[below] > lo else \
                above if above >= 0 and offset[above] < hi else -1
            if clash >= 0:
                raise PlanError(f"plan: {name(r)} [{lo}, {hi}) overlaps {name(clash)} "
                                f"[{offset[clash]}, {offset[clash] + size[clash]}) at position {pos}")
            live.add(lo, r)


def verify(plan: Plan) -> None:
    """Raise PlanError unless every planned request of ``plan`` is consistent and overlap-free."""
    n = plan.n
    if len(plan.offset) != n or len(plan.end) != n:
        raise PlanError(f"plan: {n} sizes, {len(plan.offset)} offsets and {len(plan.end)} ends")
    if n == 0:
        raise PlanError("plan: no positions: a plan places at least one request")
    if plan.region < 0 or plan.region % ALIGN:
        raise PlanError(f"plan: a region of {plan.region} bytes (a multiple of {ALIGN} is needed)")
    if not 0 <= plan.loop < n:
        raise PlanError(f"plan: the loop body starts at position {plan.loop}, outside 0..{n - 1}")
    said = plan.meta.get("region_bytes") if isinstance(plan.meta, dict) else None
    if said is not None and said != plan.region or isinstance(said, bool):  # (a replay maps the header's)
        raise PlanError(f"plan: a region of {plan.region} bytes where its figures say {said}: the file was "
                        "edited or is corrupt; make it again with `npu-pool plan`")
    prologue = plan.meta.get("prologue") if isinstance(plan.meta, dict) else None
    if prologue is not None and prologue != plan.loop:
        raise PlanError(f"plan: the loop body starts at position {plan.loop} where its figures say {prologue!r:.20}: "
                        "the file was edited or is corrupt; make it again with `npu-pool plan`")
    pos, offset, size, span = [], [], [], []
    pairs = paired(n, plan.loop, plan.size, plan.offset, plan.end)
    joined = {p: q for q, p in pairs.items()}  # one rectangle each: make_plan placed them so
    for p in range(n):
        if not 0 < plan.size[p] <= 1 << 48:
            raise PlanError(f"plan: position {p} asks for {plan.size[p]} bytes")
        limit = n if p < plan.loop else p + n - plan.loop  # a body request lives at most one pass
        if plan.end[p] != NONE and not p < plan.end[p] <= limit:  # (every row: the core checks them all)
            raise PlanError(f"plan: position {p} has end {plan.end[p]} (it must be in ({p}, {limit}], or none)")
        if plan.offset[p] == NONE:
            continue
        if plan.end[p] == NONE:
            raise PlanError(f"plan: position {p} has offset {plan.offset[p]} but no end (it must be in ({p}, {limit}])")
        if plan.offset[p] % ALIGN:
            raise PlanError(f"plan: position {p} has an unaligned offset {plan.offset[p]}")
        if p in pairs:
            continue
        pos.append(p)
        offset.append(plan.offset[p])
        size.append(aligned(plan.size[p]))
        span.extend(plan.span(p, joined.get(p)))
    verify_rects(n, offset, size, span, plan.region, lambda r: f"position {pos[r]}")
    top = max((o + s for o, s in zip(offset, size)), default=0)
    ghosts = plan.meta.get("ghosts") if isinstance(plan.meta, dict) else None
    if ghosts == 0 and not isinstance(ghosts, bool) and plan.region > top:
        # (the region is reserved whole: past its placements it holds memory nothing is placed in;
        # a plan with ghosts, rectangles the file does not keep, may reach further)
        raise PlanError(f"plan: a region of {plan.region} bytes where its placements reach {top}: the file was "
                        "edited or is corrupt; make it again with `npu-pool plan`")
