"""A recorded step run again: the trace a run that goes on past one recorded step would make.

A plan of a whole trace (one recorded step: no iteration seen to repeat) is a loop whose
next passes were never recorded. To check it against the online pool where it matters, in
the steps after the recorded one, the step is made again ``passes`` more times:

- the step is every event after those saying what was live before the recording began
  (``OP_INIT_*``), which are not made again;
- a tensor the step makes and never frees stands for an earlier tensor of its size (as the
  device is asked for it: ``sizes``) that the step frees, the k-th of a size for the k-th freed
  (the previous step's gradients, outputs): in the next pass it is freed where that one was, and
  made again; one that stands for none is made once (the optimizer states a first step creates)
  and stays live;
- set-up markers and the segment events of fidelity replays are left out; other markers, cache
  releases, failed requests, regions, pauses and resumes are repeated.

This is a model (the planner's own, :mod:`.lifetimes`): a run whose later steps differ from
its first in other ways is not what it shows.
"""
from __future__ import annotations

from collections import Counter
from typing import Sequence

from ..trace.format import (MARK_SETUP_BEGIN, MARK_SETUP_END, OP_ALLOC, OP_FREE, OP_INIT_ALLOC, OP_INIT_SEGMENT,
                            OP_MARK, OP_SEG_FREE, OP_SEG_HINT, Trace)

__all__ = ["onward", "peak_live"]

_LEFT_OUT = (OP_INIT_ALLOC, OP_INIT_SEGMENT, OP_SEG_HINT, OP_SEG_FREE)


def onward(trace: Trace, passes: int = 2, sizes: Sequence[int] | None = None) -> Trace:
    """``trace`` followed by its step (every event after the initial ones) made again ``passes``
    times, as a run that goes on would make it (see the module docstring); ``sizes``: per event,
    the bytes the device is asked for (default: the trace's sizes), by which tensors are matched."""
    op, ids, size = trace.op, trace.id, trace.size
    key = size if sizes is None else sizes
    start = next((i for i, o in enumerate(op) if o not in (OP_INIT_ALLOC, OP_INIT_SEGMENT)), len(trace))
    born: dict[int, int] = {}   # tensors the step makes, still live: id -> event
    for i in range(start, len(trace)):
        if op[i] == OP_ALLOC:
            born[ids[i]] = i
        elif op[i] == OP_FREE:
            born.pop(ids[i], None)
    made_in_step = {ids[i] for i in range(start, len(trace)) if op[i] == OP_ALLOC}
    # the step's frees of earlier tensors, each matched to a tensor the step leaves live
    kept: dict[int, list[int]] = {}
    for x, i in sorted(born.items(), key=lambda item: item[1]):
        kept.setdefault(key[i], []).append(x)
    taken: Counter = Counter()
    stands_for: dict[int, int] = {}   # event freeing an earlier tensor -> the kept tensor freed there next pass
    for i in range(start, len(trace)):
        if op[i] == OP_FREE and ids[i] not in made_in_step:
            k, xs = taken[key[i]], kept.get(key[i], ())
            if k < len(xs):
                stands_for[i] = xs[k]
                taken[key[i]] += 1
    again = set(stands_for.values())
    once = set(born) - again          # made once, live for good: not made again

    out = Trace(meta=dict(trace.meta))
    for column in ("op", "cat", "site", "id", "size", "stream", "addr"):
        getattr(out, column).extend(getattr(trace, column))
    n_ids = trace.n_ids
    previous = {x: x for x in again}  # a kept tensor's instance of the previous pass
    for _ in range(passes):
        now: dict[int, int] = {}      # this pass's ids of the step's tensors
        for i in range(start, len(trace)):
            o = op[i]
            if o in _LEFT_OUT or (o == OP_MARK and trace.cat[i] in (MARK_SETUP_BEGIN, MARK_SETUP_END)):
                continue
            if o == OP_ALLOC:
                if ids[i] in once:
                    continue
                now[ids[i]] = x = n_ids
                n_ids += 1
            elif o == OP_FREE:
                if ids[i] in now:
                    x = now[ids[i]]
                elif i in stands_for:  # (its own size: it matched the freed one as the device is asked)
                    x = previous[stands_for[i]]
                    out.append(o, id=x, size=size[born[stands_for[i]]], stream=trace.stream[i], site=trace.site[i],
                               cat=trace.cat[i])
                    continue
                else:
                    continue      # a tensor this pass never made, or one no kept tensor stands for
            else:
                x = ids[i]
            out.append(o, id=x, size=size[i], stream=trace.stream[i], site=trace.site[i], cat=trace.cat[i])
        previous = {x: now[x] for x in again}
    out.meta["n_ids"] = n_ids
    return out


def peak_live(trace: Trace) -> int:
    """The most bytes live at once in ``trace`` (what was live before it began included)."""
    live = peak = 0
    for o, x in zip(trace.op, trace.size):
        if o == OP_ALLOC or o == OP_INIT_ALLOC:
            live += x
            peak = max(peak, live)
        elif o == OP_FREE:
            live -= x
    return peak
