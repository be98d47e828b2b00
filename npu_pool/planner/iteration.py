"""Finding the steady iteration of a trace: the window of events a plan is made for.

Three ways, in order:

- ``markers``: iterations run from one ``MARK_ITER_BEGIN`` to the next. The loop body
  is the first iteration whose allocation sizes equal the next one's (so the next
  shows when the body's tensors that outlive it are freed); without two equal
  neighbours (dynamic shapes, or a trace of two steps), the second iteration, seen once.
  The iterations before it (the first step, which creates the optimizer states) are the
  prologue: planned too, once.
- ``period``: without markers, the event sequence (allocation sizes; frees by size
  and age, i.e. events since their allocation) is searched for a period P: candidate
  distances come from repeated k-grams of events, and a candidate is accepted where
  the sequence matches itself P events later for at least P events (two iterations)
  and one period allocates exactly what it frees (a layer of a forward pass repeats
  too, but it keeps its activations), and the trace is essentially that unit repeated:
  at most three periods' worth of events lie outside the periodic stretch (set-up, a
  first and a last step that differ). The backward layers of a single recorded step
  repeat and are memory-neutral too, but the forward before them is many layers long.
  The longest periodic stretch wins; the loop body is one period of it, cut where the
  fewest bytes are live (the iteration boundary, where few tensors cross), followed
  by a full period; everything before it, from the trace's first allocation, is the
  prologue (a replay of the trace runs it once).
- ``whole``: no repetition (one recorded step), or markers that say one iteration (one
  iteration marker, or one optimizer step: a period then is a part of it, micro-batches): the
  window is the whole trace, the
  allocations live before the recording began (``OP_INIT_ALLOC``) included: a replay
  makes them first, so they are its first positions, and the prologue (a run that goes on
  does not make them again); the loop body is the recorded step.
"""
from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..trace.format import (MARK_ITER_BEGIN, MARK_ITER_END, MARK_OPTIMIZER_BEGIN, OP_ALLOC, OP_FREE, OP_INIT_ALLOC,
                            OP_MARK, Trace)
from ..vocab import PLAN_AT_ITER_BEGIN, PLAN_AT_START, PLAN_MADE_ONCE

if TYPE_CHECKING:
    import torch

__all__ = ["Window", "find_window"]

_GRAM = 16          # events hashed to find repeat distances
_CANDIDATES = 64    # most frequent repeat distances tried as periods
_OUTSIDE = 3        # events outside the periodic stretch, in periods, beyond which it is not the iteration
_PRIMES = (2147483647, 2147483629)
_BASES = (1000003, 999983)


@dataclass(frozen=True)
class Window:
    """Trace events [start, end): a prologue [start, loop) run once, then the loop body
    [loop, end), one steady iteration."""

    start: int
    end: int
    method: str            # "markers", "period" or "whole"
    repeats: int           # iterations seen with the body's allocation sequence (1: not repeated)
    at_iter_begin: bool    # the first allocation of every iteration follows MARK_ITER_BEGIN
    loop: int = -1         # where the loop body starts; -1: at start (no prologue)

    @property
    def body(self) -> int:
        """Trace index where the loop body starts."""
        return self.start if self.loop < 0 else self.loop

    @property
    def flags(self) -> int:
        """np_set_plan's flags: position 0 follows MARK_ITER_BEGIN; it is the first request; what
        the body holds for good was made once (a whole trace: the steps after it skip it)."""
        return (PLAN_AT_ITER_BEGIN if self.at_iter_begin else 0) | (PLAN_AT_START if self.method != "markers" else 0) \
            | (PLAN_MADE_ONCE if self.method == "whole" else 0)


class NothingToPlan(ValueError):
    """The trace holds no request to plan (a recording of frees only)."""


def find_window(trace: Trace) -> Window:
    """The steady iteration of ``trace`` (see the module docstring)."""
    if not any(op == OP_ALLOC for op in trace.op):
        raise NothingToPlan("the trace has no allocations to plan")
    return _by_markers(trace) or (None if _one_iteration(trace) else _by_period(trace)) or _whole(trace)


def _one_iteration(trace: Trace) -> bool:
    """Whether the trace's markers say it holds one iteration (one iteration marker, or none and one
    optimizer step): then a period in it is a part of that iteration (micro-batches of gradient
    accumulation repeat, and are memory-neutral too), not the loop, and the plan is of the whole
    trace."""
    marks = Counter(cat for op, cat in zip(trace.op, trace.cat) if op == OP_MARK)
    return marks[MARK_ITER_BEGIN] == 1 or (not marks[MARK_ITER_BEGIN] and marks[MARK_OPTIMIZER_BEGIN] == 1)


def _whole(trace: Trace) -> Window:
    start = _first(trace)
    body = next(i for i in range(start, len(trace)) if trace.op[i] == OP_ALLOC)
    return Window(start, len(trace), "whole", 1, False, body if trace.op[start] == OP_INIT_ALLOC else -1)


def _by_markers(trace: Trace) -> Window | None:
    op, cat = trace.op, trace.cat
    begins = [i for i in range(len(trace)) if op[i] == OP_MARK and cat[i] == MARK_ITER_BEGIN]
    if len(begins) < 2:
        return None
    bounds = begins + [len(trace)]
    sigs = []
    for b, e in zip(bounds, bounds[1:]):
        sig = []
        for i in range(b, e):
            if op[i] == OP_ALLOC:
                sig.append(trace.size[i])
            elif op[i] == OP_MARK and cat[i] == MARK_ITER_END:
                break
        sigs.append(tuple(sig))
    steady = [i for i in range(len(sigs) - 1) if sigs[i] and sigs[i] == sigs[i + 1]]
    # no two equal neighbours (dynamic shapes, or only two steps): the second iteration that
    # allocates is the body, seen once, and what comes before (the first step, which creates the
    # optimizer states) the prologue; none (a trace cut after the next step's marker): no window
    k = steady[0] if steady else next((i for i in range(1, len(sigs)) if sigs[i]), None)
    if k is None:
        return None

    def first_is_alloc(b: int) -> bool:
        first = next((i for i in range(b + 1, len(trace)) if op[i] in (OP_ALLOC, OP_MARK)), None)
        return first is not None and op[first] == OP_ALLOC

    at_begin = all(first_is_alloc(b) for b in begins[:k + 1])
    return Window(begins[0], bounds[k + 1], "markers", sum(s == sigs[k] for s in sigs), at_begin, begins[k])


def _signature(trace: Trace) -> tuple["array[int]", torch.Tensor, torch.Tensor, torch.Tensor]:
    """Alloc/free events: their trace indices, sizes, ages (-1 for allocs), signed sizes. Gathered
    in arrays, not lists of ints (four of those held 200 MB over a trace of 1.35M events)."""
    import torch  # (imported here: reading a plan, which imports this module, needs no torch)

    index, sizes, ages = array("q"), array("q"), array("q")
    born: dict[int, int] = {}
    for i, (op, id_, size) in enumerate(zip(trace.op, trace.id, trace.size)):
        if op == OP_ALLOC:
            born[id_] = len(index)
            index.append(i); sizes.append(size); ages.append(-1)
        elif op == OP_FREE:
            b = born.pop(id_, None)
            index.append(i); sizes.append(size); ages.append(-2 if b is None else len(index) - 1 - b)

    def column(a: "array[int]") -> torch.Tensor:  # (a copy: the tensor outlives the array's use here)
        return torch.frombuffer(a, dtype=torch.int64).clone() if a else torch.zeros(0, dtype=torch.int64)

    sizes_t, ages_t = column(sizes), column(ages)
    return index, sizes_t, ages_t, torch.where(ages_t == -1, sizes_t, -sizes_t)


def _candidates(sizes: torch.Tensor, ages: torch.Tensor) -> list[int]:
    """Distances at which k-grams of events repeat, most frequent first."""
    import torch

    m = sizes.numel() - _GRAM + 1
    if m < 2:
        return []
    key = torch.zeros(m, dtype=torch.int64)
    for prime, base in zip(_PRIMES, _BASES):
        sig = torch.remainder(sizes * 31 + ages, prime)
        h = torch.zeros(m, dtype=torch.int64)
        for j in range(_GRAM):
            h = torch.remainder(h * base + sig[j:j + m], prime)
        key = key * prime + h
    sk, order = torch.sort(key, stable=True)
    same = sk[1:] == sk[:-1]
    dist = (order[1:] - order[:-1])[same]
    if dist.numel() == 0:
        return []
    counts = torch.bincount(dist)
    counts[:2] = 0
    top = torch.topk(counts, min(_CANDIDATES, counts.numel()))
    return [int(d) for c, d in zip(top.values.tolist(), top.indices.tolist()) if c >= 2]


def _longest_run(eq: torch.Tensor) -> tuple[int, int]:
    """Length and start of the longest run of True."""
    import torch

    idx = torch.arange(eq.numel())
    last_false = torch.cummax(torch.where(eq, torch.full_like(idx, -1), idx), 0).values
    run = idx - last_false
    best = int(run.max()) if run.numel() else 0
    return best, (int(run.argmax()) - best + 1) if best else 0


def _by_period(trace: Trace) -> Window | None:
    import torch

    index, sizes, ages, delta = _signature(trace)
    best = None  # (run, -period, start)
    for p in _candidates(sizes, ages):
        if 2 * p > sizes.numel():
            continue
        eq = (sizes[:-p] == sizes[p:]) & (ages[:-p] == ages[p:])
        run, r0 = _longest_run(eq)
        if run < p or sizes.numel() - (run + p) > _OUTSIDE * p or int(delta[r0:r0 + p].sum()) != 0:
            continue
        if best is None or (run, -p) > best[:2]:
            best = (run, -p, r0)
    if best is None:
        return None
    run, p, r0 = best[0], -best[1], best[2]
    lo, hi = r0, min(r0 + p - 1, r0 + run - p)  # a full period follows the body
    initial = sum(s for op, s in zip(trace.op, trace.size) if op == OP_INIT_ALLOC)
    live = torch.cumsum(delta, 0) - delta + initial   # live bytes before each event
    s = lo + int(torch.argmin(live[lo:hi + 1]))
    return Window(_first(trace), index[s + p], "period", (run + p) // p, False, index[s])


def _first(trace: Trace) -> int:
    """The first allocation event, those made before the recording began included."""
    return next(i for i, op in enumerate(trace.op) if op in (OP_ALLOC, OP_FREE, OP_INIT_ALLOC))
