"""Statistics of a trace that need no allocator: live bytes, op counts."""
from __future__ import annotations

import array
import hashlib
import sys
import dataclasses
from typing import NamedTuple

from ..vocab import NPU_PAD
from .format import CAT_NAMES, OP_ALLOC, OP_FREE, OP_INIT_ALLOC, OP_MARK, OP_NAMES, OP_OOM, Trace
from .format import OP_PAUSE, OP_REGION, OP_RESUME  # tagged regions (docs/colocated.md)

__all__ = ["LiveProfile", "live_profile", "initial_live_bytes", "op_counts", "alloc_sizes", "fingerprint", "contains",
           "summarize"]


class LiveProfile(NamedTuple):
    """Peak of the bytes requested and not yet freed, and the event index where it is reached."""

    peak_bytes: int
    peak_index: int  # -1 for a trace without allocations


def live_profile(trace: Trace) -> LiveProfile:
    """Peak live bytes (requested sizes, initial allocations included) and the first event reaching it.
    Tensors of a paused tag (``OP_PAUSE``) are not on the device until their ``OP_RESUME``."""
    if OP_REGION in trace.op:
        return _paused_live_profile(trace)
    live = peak = 0
    at = -1
    for i, (op, size) in enumerate(zip(trace.op, trace.size)):
        if op == OP_ALLOC or op == OP_INIT_ALLOC:
            live += size
            if live > peak:
                peak, at = live, i
        elif op == OP_FREE:
            live -= size
    return LiveProfile(peak, at)


def _paused_live_profile(trace: Trace) -> LiveProfile:
    """live_profile of a trace with tagged regions: a paused tag's live bytes leave the device."""
    live = peak = 0
    at, region = -1, -1
    tag_of: dict[int, int] = {}
    tag_live: dict[int, int] = {}
    paused: set[int] = set()
    for i, (op, iid, size) in enumerate(zip(trace.op, trace.id, trace.size)):
        if op == OP_ALLOC or op == OP_INIT_ALLOC:
            tag_of[iid] = region
            tag_live[region] = tag_live.get(region, 0) + size
            live += size
        elif op == OP_FREE:
            t = tag_of.pop(iid, -1)
            tag_live[t] = tag_live.get(t, 0) - size
            if t not in paused:
                live -= size
        elif op == OP_REGION:
            region = iid
        elif op == OP_PAUSE and iid not in paused:
            paused.add(iid)
            live -= tag_live.get(iid, 0)
        elif op == OP_RESUME and iid in paused:
            paused.discard(iid)
            live += tag_live.get(iid, 0)
        if live > peak:
            peak, at = live, i
    return LiveProfile(peak, at)


def initial_live_bytes(trace: Trace) -> int:
    """Bytes already live when the recorded window began (sum of OP_INIT_ALLOC sizes)."""
    return sum(s for op, s in zip(trace.op, trace.size) if op == OP_INIT_ALLOC)


def op_counts(trace: Trace) -> dict[str, int]:
    """Number of events of each op, by name (ops that do not occur are left out)."""
    counts = [0] * 256
    for op in trace.op:
        counts[op] += 1
    return {OP_NAMES[op] if op < len(OP_NAMES) else str(op): n for op, n in enumerate(counts) if n}


_REQUESTS = (OP_ALLOC, OP_INIT_ALLOC, OP_FREE, OP_OOM)  # events whose size is a request's


def device_requests(trace: Trace, device: str) -> Trace:
    """``trace`` as ``device``'s allocator is asked: under torch_npu's rules (``"npu"``) every
    request (allocation, its free, a failed request) is rounded up to NPU_PAD bytes and NPU_PAD
    more, as the simulator pads it before a policy sees it; on any other device ``trace`` itself."""
    if device != "npu":
        return trace
    size = array.array("Q", ((s + NPU_PAD - 1) // NPU_PAD * NPU_PAD + NPU_PAD if op in _REQUESTS else s
                             for op, s in zip(trace.op, trace.size)))
    return dataclasses.replace(trace, size=size)


def alloc_sizes(trace: Trace) -> array.array:
    """The requested sizes of the trace's allocations, in order (initial ones first)."""
    return array.array("Q", (s for op, s in zip(trace.op, trace.size) if op == OP_ALLOC or op == OP_INIT_ALLOC))


def fingerprint(sizes: array.array) -> str:
    """A short hash of a sequence of allocation sizes (a trace's, or a plan's iteration)."""
    data = array.array("Q", sizes)
    if sys.byteorder != "little":
        data.byteswap()
    return hashlib.sha256(data.tobytes()).hexdigest()[:16]


def contains(sizes: array.array, part: array.array) -> bool:
    """Whether ``part`` occurs in ``sizes`` as a run of consecutive entries."""
    if not part:
        return True
    hay, needle = array.array("Q", sizes).tobytes(), array.array("Q", part).tobytes()
    at = hay.find(needle)
    while at >= 0 and at % 8:  # a match must start at an entry
        at = hay.find(needle, at + 1)
    return at >= 0


def summarize(trace: Trace) -> dict[str, Any]:
    """Event counts, peak live bytes and the bytes per category at that peak."""
    live = 0
    by_cat = [0] * len(CAT_NAMES)
    peak, peak_at, peak_cats = 0, -1, list(by_cat)
    allocs = frees = marks = 0
    for i, (op, cat, size) in enumerate(zip(trace.op, trace.cat, trace.size)):
        if op in (OP_ALLOC, OP_INIT_ALLOC):
            allocs += 1
            live += size
            by_cat[cat] += size
            if live > peak:
                peak, peak_at, peak_cats = live, i, list(by_cat)
        elif op == OP_FREE:
            frees += 1
            live -= size
            by_cat[cat] -= size
        elif op == OP_MARK:
            marks += 1
    return {"events": len(trace), "allocs": allocs, "frees": frees, "marks": marks, "peak_bytes": peak,
            "peak_event": peak_at, "end_bytes": live,
            "peak_by_category": {CAT_NAMES[c]: b for c, b in enumerate(peak_cats) if b}}
