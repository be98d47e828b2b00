"""trace -> plan: find the steady iteration, lay out its lifetimes, place, verify."""
from __future__ import annotations

import array
import time
from typing import Callable, Sequence

from ..replay import past_the_device
from ..trace.format import Trace, device_type
from ..trace.stats import device_requests, fingerprint
from .check import ONLINE, compare_online
from .iteration import find_window
from .lifetimes import build_layout
from .place import ORDERS, Rects, place
from .plan import NONE, Plan, aligned, span
from .verify import verify_rects

__all__ = ["make_plan", "STAGES"]


STAGES = ("iteration", "layout", "placement", "check")  # what make_plan's on_stage hears, in order


def make_plan(trace: Trace, name: str = "", orders: Sequence[str] = tuple(ORDERS), *, check: bool = True,
              on_stage: Callable[[str], None] | None = None) -> Plan:
    """Plan the steady iteration of ``trace``; the plan is verified overlap-free and (``check``)
    compared with the online pool on ``trace``: a plan that would be worse runs online
    (``meta["online"]`` says why; :mod:`.check`).

    ``meta`` records the window and the figures, each in the bytes the device is asked for
    (under torch_npu's rules, padded): ``peak_live_bytes`` (the window's peak of live bytes,
    everything included: the lower bound; a whole trace's, of the step followed by the step
    made again), ``region_bytes``,
    ``outside_peak_bytes`` (static and unplanned bytes, held by the fallback),
    ``planned_peak_bytes`` (region + outside) and ``ratio`` (planned / peak live).
    ``on_stage(stage)`` is called as each of :data:`STAGES` begins (progress on long traces)."""
    stage = on_stage or (lambda _s: None)
    t0 = time.perf_counter()
    device = device_type(trace)  # whose request rules the device applies: the plan holds what it is asked
    asked = device_requests(trace, device)
    too_large = past_the_device(asked, name or "the trace")
    if too_large:  # (the placement would refuse its rectangle, the comparison its replay)
        raise too_large
    stage("iteration")
    w = find_window(asked)
    stage("layout")
    lay = build_layout(asked, w)
    n = lay.n
    rects = Rects(n)
    who: list[int] = []  # position of each rectangle, -1 for a ghost
    joined = {p: q for q, p in lay.pairs.items()}  # a prologue tensor and the request standing for it: one rectangle
    for p in range(n):
        if lay.end[p] != NONE and p not in lay.pairs:
            rects.add(aligned(lay.size[p]), *span(n, lay.loop, p, lay.end[p], joined.get(p)))
            who.append(p)
    for size, e in lay.ghosts:
        rects.add(aligned(size), 0, e)
        who.append(-1)
    stage("placement")
    placed = place(rects, orders)
    verify_rects(n, placed.offset, rects.size, rects.span, placed.peak,
                 lambda r: f"position {who[r]}" if who[r] >= 0 else f"ghost {r}")
    offset = array.array("Q", [NONE]) * n
    for r, p in enumerate(who):
        if p >= 0:
            offset[p] = placed.offset[r]
    for q, p in lay.pairs.items():
        offset[q] = offset[p]
    planned_peak = placed.peak + lay.outside_peak
    meta = {
        "source": name or str(trace.meta.get("origin", "")), "device": device,
        "iteration_fingerprint": fingerprint(lay.size[lay.loop:]),
        "method": w.method, "window": [w.start, w.end], "loop_event": w.body, "repeats": w.repeats,
        "positions": n, "prologue": lay.loop, "paired": len(lay.pairs), "unplanned": lay.unplanned,
        "ghosts": len(lay.ghosts), "order": placed.order,
        "peak_live_bytes": lay.peak_live, "region_bytes": placed.peak, "static_bytes": lay.static_bytes,
        "outside_peak_bytes": lay.outside_peak, "planned_peak_bytes": planned_peak,
        "ratio": planned_peak / lay.peak_live if lay.peak_live else 1.0,
        "seconds": round(time.perf_counter() - t0, 3),
    }
    plan = Plan(lay.size, offset, lay.end, placed.peak, lay.loop, w.flags, meta)
    if check:
        stage("check")
        cmp = compare_online(trace, plan, name or "the trace")
        meta.update(replay_reserved_bytes=cmp["planned_reserved_bytes"],
                    online_reserved_bytes=cmp["online_reserved_bytes"], replay_counts=cmp["plan_counts"])
        if "onward_skipped" in cmp:
            meta["onward_skipped"] = cmp["onward_skipped"][:300]
        if "onward_planned_reserved_bytes" in cmp:
            meta.update(onward_passes=cmp["onward_passes"], onward_reserved_bytes=cmp["onward_planned_reserved_bytes"],
                        onward_online_reserved_bytes=cmp["onward_online_reserved_bytes"])
        if cmp["worse"]:
            meta[ONLINE] = "; ".join(cmp["worse"])
        meta["seconds"] = round(time.perf_counter() - t0, 3)
    return plan
