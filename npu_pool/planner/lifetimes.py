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

When nothing follows the window (``whole``: one recorded step, its prologue the tensors
live before the recording began), a run that goes on makes the step again. A body request
never freed then wraps: the k-th of its size stands for the k-th prologue tensor of that
size freed in the body (the previous step's instance: it is freed at that position of the
next pass), and one that stands for none is made once and held for good (the optimizer
states a first step creates): its range is its own throughout the body. The prologue tensor
and the body request that stands for it are one rectangle at one offset (``pairs``): in the
first pass the prologue's tensor holds the range the next passes' previous instance holds
(as two rectangles the plan would hold both at once in the first pass). Tensors allocated
before the window and freed inside it are the previous instances of wrapping requests
(without a prologue); those no wrapping request accounts for become "ghosts": rectangles
[0, end) that take room in the plan and are never served. Tensors live through the whole
window (weights, ...) are outside the plan: the fallback holds them.
"""
from __future__ import annotations

import array
from collections import Counter
from dataclasses import dataclass, field
from itertools import accumulate

from ..trace.format import OP_ALLOC, OP_FREE, OP_INIT_ALLOC, Trace
from .iteration import Window
from .onward import onward, peak_live

__all__ = ["Layout", "NONE", "build_layout"]

NONE = (1 << 64) - 1  # end of an unplanned position (and offset of one)


@dataclass
class Layout:
    """One iteration's requests and what surrounds them (requested bytes throughout)."""

    size: array.array                 # per position: requested bytes
    end: array.array                  # per position: end position, NONE if unplanned
    loop: int = 0                     # first position of the loop body (0: no prologue)
    ghosts: list[tuple[int, int]] = field(default_factory=list)  # (bytes, end): live [0, end), never served
    pairs: dict[int, int] = field(default_factory=dict)  # prologue position -> the body position at its offset
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
    after, witness = _ends_after(trace, w, pos_of, ends, sizes, m)
    end = array.array("Q", [NONE]) * n
    pairs: dict[int, int] = {}
    if w.method == "whole":  # nothing follows: the step made again takes the place of the prologue's
        after, pairs = _step_again(sizes, ends, m)
    for p, e in enumerate(ends):
        if e < 0:
            e = after.get(p, -1)
        if p < m:  # prologue: held through the body when it outlives its first pass
            end[p] = e if 0 <= e <= n else n
        else:  # (never freed: unplanned)
            end[p] = e if 0 <= e <= p + body else NONE
    wraps = Counter((sizes[p], end[p] - n) for p in range(m, n) if end[p] != NONE and end[p] > n and not m)
    ghosts = []
    for s, e in freed_pre:
        if wraps[(s, e)] > 0:
            wraps[(s, e)] -= 1
        elif e > 0:
            ghosts.append((s, e))
    static = sum(pre.values())
    if w.method == "whole":  # the loop holds what the recorded step makes once from then on
        peak = max(peak, peak_live(onward(trace, 1)))  # (the model the plan is checked on: .check)
    freed = [e if e >= 0 else after.get(p, -1) for p, e in enumerate(ends)]
    return Layout(sizes, end, m, ghosts, pairs, static, static + _unplanned_peak(sizes, end, freed, m, witness), peak)


def _step_again(sizes: array.array, ends: list[int], m: int) -> tuple[dict[int, int], dict[int, int]]:
    """End positions of a whole window's body requests never freed, in a run that makes the
    recorded step again, and the pairs (prologue position -> body position) that share a range.
    The k-th such request of a size stands for the k-th prologue tensor of that size freed in the
    body: it is freed where that one was (n + its position in the body), unless that is after the
    request itself (it would live longer than a pass: unplanned). One that stands for none is
    held for good (p + body: its range throughout the body)."""
    n = len(sizes)
    freed: dict[int, list[int]] = {}  # size -> prologue positions freed in the body, in the order freed
    for q in sorted((q for q in range(m) if ends[q] >= m), key=lambda q: ends[q]):
        freed.setdefault(sizes[q], []).append(q)
    taken: Counter = Counter()
    out: dict[int, int] = {}
    pairs: dict[int, int] = {}
    for p in range(m, n):
        if ends[p] < 0:
            s = sizes[p]
            k = taken[s]
            taken[s] += 1
            qs = freed.get(s, ())
            if k >= len(qs):
                out[p] = p + (n - m)
            elif ends[qs[k]] <= p:
                out[p] = n + ends[qs[k]] - m
                if ends[qs[k]] > m:  # (freed before the step allocates: no wrap, no range in common)
                    pairs[qs[k]] = p
    return out, pairs


WITNESSES = 4  # later passes whose instance of a body position shows how long such tensors live


def _unplanned_peak(sizes: array.array, end: array.array, freed: list[int], m: int,
                    witness: list[tuple[int, int] | None]) -> int:
    """Highest bytes live at a position in unplanned window requests, in the steady loop. A body
    request freed in a later pass (``freed[p]`` past n: n + the allocations before its free) is
    still live when the next passes make their own, so the loop holds earlier passes' instances
    too: that of j passes before over the body's positions below ``end - j * body`` (the whole
    body when that is past it). How many passes later instances are freed is the fewest that the
    window's instance and the next passes' instances of the same position show (``witness``, from
    :func:`_ends_after`): a queue two deep (prefetching two steps ahead) holds two earlier
    instances, and one kept for good by a next pass says nothing of the others.
    Where the next passes show nothing, the previous pass's instance and no more. The window's
    instance kept longer than the next passes show (never freed, or freed at the run's end) is held
    through the body besides the instances the next passes show, once (not once per pass)."""
    n = len(sizes)
    body = n - m
    diff = [0] * (n + 1)
    for p in range(n):
        if end[p] != NONE:
            continue
        s, e = sizes[p], freed[p]
        w = witness[p - m] if m <= p and body > 0 and not 0 <= e <= n else None
        if w is None:
            diff[p] += s
            diff[e if 0 <= e <= n else n] -= s
            if e > n and m <= p and body > 0:  # nothing shown: the previous pass's instance only
                diff[m] += s
                diff[m + min(e - n, body)] -= s
            continue
        passes, rest = w
        if e < 0 or passes < (e - m - 1) // body:  # the window's is kept longer than the next passes keep theirs:
            diff[m] += s  # held through the body of the passes after it, besides theirs
            diff[n] -= s
            e = m + passes * body + rest
        diff[p] += s
        diff[min(e, n)] -= s
        whole = max(e - n, 0) // body  # earlier instances live through the whole body ...
        diff[m] += s * whole
        diff[n] -= s * whole
        part = e - (whole + 1) * body  # ... and the one before them, over its first positions
        if part > m:
            diff[m] += s
            diff[part] -= s
    return max(accumulate(diff), default=0)


def _ends_after(trace: Trace, w: Window, pos_of: dict[int, int], ends: list[int], sizes: array.array,
                m: int) -> tuple[dict[int, int], list[tuple[int, int] | None]]:
    """End positions of window requests freed after the window (n + allocations before the free),
    and per body position what its instances in the next WITNESSES passes show: the allocations
    after the window at that position plus multiples of the body, while each has the window's size
    (a pass of another shape ends a position's witnesses there). Each freed one was freed in some
    later pass, at some position of it: (passes later, position in that pass, 1..body), the fewest
    passes and of those the latest position; None where none was freed while recorded. Passes,
    not positions, are compared: a later pass shorter than the body (a step that skips a request)
    moves where a free falls, rarely in which pass."""
    n = len(sizes)
    body = n - m
    waiting = {trace.id[i]: pos_of[trace.id[i]] for i in range(w.start, w.end)
               if trace.op[i] == OP_ALLOC and ends[pos_of[trace.id[i]]] < 0}
    out: dict[int, int] = {}
    witness: list[tuple[int, int] | None] = [None] * body
    matching = [True] * body  # a position's witnesses so far had its size
    born: dict[int, int] = {}  # witnesses not freed yet: id -> allocations after the window before it
    allocs = 0
    for i in range(w.end, len(trace)):
        if not waiting and not born and allocs >= WITNESSES * body:
            break
        o = trace.op[i]
        if o == OP_ALLOC:
            if allocs < WITNESSES * body:
                a = allocs % body
                matching[a] = matching[a] and trace.size[i] == sizes[m + a]
                if matching[a]:
                    born[trace.id[i]] = allocs
            allocs += 1
        elif o == OP_FREE:
            p = waiting.pop(trace.id[i], None)
            if p is not None:
                out[p] = n + allocs
            q = born.pop(trace.id[i], None)
            if q is not None:
                a = q % body
                x = a + allocs - q  # where it was freed, counted from its pass's start
                seen = ((x - 1) // body, (x - 1) % body + 1)
                old = witness[a]
                if old is None or seen[0] < old[0] or (seen[0] == old[0] and seen[1] > old[1]):
                    witness[a] = seen
    return out, witness
