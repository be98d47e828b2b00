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

__all__ = ["LiveProfile", "live_profile", "Regions", "initial_live_bytes", "op_counts", "alloc_sizes", "fingerprint",
           "contains", "summarize"]


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


class Regions:
    """Tagged regions as a trace plays them (``OP_REGION``, ``OP_PAUSE``, ``OP_RESUME``;
    docs/colocated.md): the tag each live tensor was allocated in and which tags are paused. A
    paused tag's tensors are off the device from its pause to its resume; a pause of a paused
    tag, or a resume of one that is not, moves nothing."""

    def __init__(self) -> None:
        self.region = -1                          # the tag requests go to now (-1: none)
        self.paused: set[int] = set()
        self.live: dict[int, dict[int, int]] = {}  # tag -> {id of a live tensor: the event allocating it}
        self.bytes: dict[int, int] = {}           # tag -> its live tensors' bytes
        self._tag_of: dict[int, int] = {}

    def alloc(self, id_: int, index: int, size: int) -> None:
        if self.region != -1:  # (untagged tensors are never paused)
            self._tag_of[id_] = self.region
            self.live.setdefault(self.region, {})[id_] = index
            self.bytes[self.region] = self.bytes.get(self.region, 0) + size

    def free(self, id_: int, size: int) -> bool:
        """Forget a freed tensor; whether it was on the device (not in a paused tag)."""
        tag = self._tag_of.pop(id_, -1)
        if tag == -1:
            return True
        del self.live[tag][id_]
        self.bytes[tag] -= size
        return tag not in self.paused

    def switch(self, op: int, tag: int) -> int:
        """Play an ``OP_REGION``, ``OP_PAUSE`` or ``OP_RESUME`` of ``tag``: -1 when the tag's live
        tensors leave the device (a pause), +1 when they come back (a resume), else 0."""
        if op == OP_REGION:
            self.region = tag
        elif op == OP_PAUSE and tag not in self.paused:
            self.paused.add(tag)
            return -1
        elif op == OP_RESUME and tag in self.paused:
            self.paused.discard(tag)
            return 1
        return 0


def _paused_live_profile(trace: Trace) -> LiveProfile:
    """live_profile of a trace with tagged regions: a paused tag's live bytes leave the device."""
    live = peak = 0
    at = -1
    regions = Regions()
    for i, (op, iid, size) in enumerate(zip(trace.op, trace.id, trace.size)):
        if op == OP_ALLOC or op == OP_INIT_ALLOC:
            regions.alloc(iid, i, size)
            live += size
        elif op == OP_FREE:
            if regions.free(iid, size):
                live -= size
        elif op in (OP_REGION, OP_PAUSE, OP_RESUME):
            sign = regions.switch(op, iid)
            if sign:
                live += sign * regions.bytes.get(iid, 0)
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
