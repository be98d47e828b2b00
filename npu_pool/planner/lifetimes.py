"""Lifetimes of one iteration's requests, in positions, and the live-byte figures around them.

Time is counted in positions: the k-th allocation of the window is position k, and a
tensor freed after the k-th allocation (and before the next) ends at k. Positions
[0, m) are the prologue (run once), [m, N) the loop body (n = N - m positions, run
again and again). A request at position p that is freed at end is live for [p, end):

- freed inside the window: end <= N;
- a body request freed in the next iteration: end = N + (allocations of the next
  iteration before the free). In a steady loop its previous instance is then live at
  [m, m + end - N) of this iteration: the rectangle wraps around the boundary, at one
  offset;
- a body request live for more than an iteration (end > p + n), or never freed while
  later iterations were recorded: unplanned, the fallback serves it;
- a prologue request still live after the first pass of the body: end = N, its range
  is held through the whole body (the optimizer states the first step creates).

When nothing follows the window (``whole``), tensors still live at its end are
planned until the end. Tensors allocated before the window and freed inside it are
the previous instances of wrapping requests (without a prologue); those no wrapping
request accounts for become "ghosts": rectangles [0, end) that take room in the plan
and are never served. Tensors live through the whole window (weights, ...) are
outside the plan: the fallback holds them.
"""
from __future__ import annotations

import array
from collections import Counter
from dataclasses import dataclass, field
from itertools import accumulate

from ..trace.format import OP_ALLOC, OP_FREE, OP_INIT_ALLOC, Trace
from .iteration import Window

__all__ = ["Layout", "NONE", "build_layout"]

NONE = (1 << 64) - 1  # end of an unplanned position (and offset of one)


@dataclass
class Layout:
    """One iteration's requests and what surrounds them (requested bytes throughout)."""

    size: array.array                 # per position: requested bytes
    end: array.array                  # per position: end position, NONE if unplanned
    loop: int = 0                     # first position of the loop body (0: no prologue)
    ghosts: list[tuple[int, int]] = field(default_factory=list)  # (bytes, end): live [0, end), never served
    static_bytes: int = 0             # live through the whole window, outside the plan
    outside_peak: int = 0             # highest bytes live outside the plan (static and unplanned)
    peak_live: int = 0                # the window's peak live bytes, everything included

    @property
    def n(self) -> int:
        return len(self.size)

    @property
    def unplanned(self) -> int:
        return sum(e == NONE for e in self.end)


def build_layout(trace: Trace, w: Window) -> Layout:
    """Positions, lifetimes, ghosts and live-byte figures of window ``w`` of ``trace``."""
    op, ids, size = trace.op, trace.id, trace.size
    live: dict[int, int] = {}
    for i in range(w.start):  # what is live when the window opens
        if op[i] == OP_ALLOC or op[i] == OP_INIT_ALLOC:
            live[ids[i]] = size[i]
        elif op[i] == OP_FREE:
            live.pop(ids[i], None)
    pre = dict(live)
    live_bytes = peak = sum(live.values())
    pos_of: dict[int, int] = {}
    sizes = array.array("Q")
    ends: list[int] = []
    freed_pre: list[tuple[int, int]] = []
    init_too = w.method != "markers"  # the window opens at the trace's first allocation: those made
    # before the recording began (OP_INIT_ALLOC) are positions too, a replay makes them first
    m = 0
    for i in range(w.start, w.end):
        if i == w.body:
            m = len(sizes)
        o = op[i]
        if o == OP_ALLOC or (init_too and o == OP_INIT_ALLOC):
            pos_of[ids[i]] = len(sizes)
            sizes.append(size[i])
            ends.append(-1)
            live_bytes += size[i]
            peak = max(peak, live_bytes)
        elif o == OP_FREE:
            live_bytes -= size[i]
            p = pos_of.get(ids[i])
            if p is not None:
                ends[p] = len(sizes)
            elif ids[i] in pre:
                freed_pre.append((pre.pop(ids[i]), len(sizes)))
    n = len(sizes)
    body = n - m
    after, next_life = _ends_after(trace, w, pos_of, ends, n, body)
    end = array.array("Q", [NONE]) * n
    for p, e in enumerate(ends):
        if e < 0:
            e = after.get(p, -1)
        if p < m:  # prologue: held through the body when it outlives its first pass
            end[p] = e if 0 <= e <= n else n
        elif e < 0:  # never freed
            end[p] = n if w.method == "whole" else NONE
        else:
            end[p] = e if e <= p + body else NONE
    wraps = Counter((sizes[p], end[p] - n) for p in range(m, n) if end[p] != NONE and end[p] > n and not m)
    ghosts = []
    for s, e in freed_pre:
        if wraps[(s, e)] > 0:
            wraps[(s, e)] -= 1
        elif e > 0:
            ghosts.append((s, e))
    static = sum(pre.values())
    freed = [e if e >= 0 else after.get(p, -1) for p, e in enumerate(ends)]
    return Layout(sizes, end, m, ghosts, static, static + _unplanned_peak(sizes, end, freed, m, next_life), peak)


def _ends_after(trace: Trace, w: Window, pos_of: dict[int, int], ends: list[int], n: int) -> dict[int, int]:
    """End positions of window requests freed after the window: n + allocations before the free."""
    waiting = {trace.id[i]: pos_of[trace.id[i]] for i in range(w.start, w.end)
               if trace.op[i] == OP_ALLOC and ends[pos_of[trace.id[i]]] < 0}
    out: dict[int, int] = {}
    allocs = 0
    for i in range(w.end, len(trace)):
        if not waiting:
            break
        o = trace.op[i]
        if o == OP_ALLOC:
            allocs += 1
        elif o == OP_FREE:
            p = waiting.pop(trace.id[i], None)
            if p is not None:
                out[p] = n + allocs
    return out


def _unplanned_peak(sizes: array.array, end: array.array, freed: list[int], m: int, next_life: list[int]) -> int:
    """Highest bytes live at a position in unplanned window requests, in the steady loop. A body
    request freed in a later pass (``freed[p]`` past n: n + the allocations before its free) is
    still live when the next passes make their own, so the loop holds earlier passes' instances
    too: that of j passes before over the body's positions below ``end - j * body`` (the whole
    body when that is past it), for end the position where this instance and the next pass's
    instance of the same position (``next_life``: its lifetime) both show it ending. A queue two
    deep (prefetching two steps ahead) so holds two earlier instances. Where the next instance
    is not freed while recorded, the previous pass's instance and no more: one kept for good (the
    first step's, say) says nothing of how long the others are kept. One freed in the window, or
    never (-1), is live to its free or the window's end."""
    n = len(sizes)
    body = n - m
    diff = [0] * (n + 1)
    for p in range(n):
        if end[p] != NONE:
            continue
        s, e = sizes[p], freed[p]
        diff[p] += s
        diff[e if 0 <= e <= n else n] -= s
        if e <= n or p < m or body <= 0:
            continue
        nxt = next_life[p - m]
        if nxt < 0:  # unknown: the previous pass's instance only
            diff[m] += s
            diff[m + min(e - n, body)] -= s
            continue
        e = p + min(e - p, nxt)
        whole = max(e - n, 0) // body  # earlier instances live through the whole body ...
        diff[m] += s * whole
        diff[n] -= s * whole
        part = e - (whole + 1) * body  # ... and the one before them, over its first positions
        if part > m:
            diff[m] += s
            diff[part] -= s
    return max(accumulate(diff), default=0)


def _ends_after(trace: Trace, w: Window, pos_of: dict[int, int], ends: list[int], n: int,
                body: int) -> tuple[dict[int, int], list[int]]:
    """End positions of window requests freed after the window (n + allocations before the free),
    and the lifetime in positions of each of the first ``body`` allocations after it, the next
    pass's instances of the body's positions (-1 where not freed while recorded)."""
    waiting = {trace.id[i]: pos_of[trace.id[i]] for i in range(w.start, w.end)
               if trace.op[i] == OP_ALLOC and ends[pos_of[trace.id[i]]] < 0}
    out: dict[int, int] = {}
    next_life = [-1] * body
    born: dict[int, int] = {}  # the next pass's allocations not freed yet: id -> allocations before it
    allocs = 0
    for i in range(w.end, len(trace)):
        if not waiting and not born and allocs >= body:
            break
        o = trace.op[i]
        if o == OP_ALLOC:
            if allocs < body:
                born[trace.id[i]] = allocs
            allocs += 1
        elif o == OP_FREE:
            p = waiting.pop(trace.id[i], None)
            if p is not None:
                out[p] = n + allocs
            a = born.pop(trace.id[i], None)
            if a is not None:
                next_life[a] = allocs - a
    return out, next_life
