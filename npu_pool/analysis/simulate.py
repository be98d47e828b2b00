"""Replay a trace through a :class:`~npu_pool.pool.Pool` event by event, watching reserved memory.

:func:`npu_pool.replay.run` is the fast path (the loop in C) and gives the figures;
this one makes the same calls from Python (same sizes, streams, sites, markers and
``empty_cache``; initial allocations long-lived) so it can also record, after every
event, the bytes reserved and how the reserved ranges changed, and keep the pool's
block map at the end. That is what timelines and memory_viz exports need.

Reserved ranges are what a memory snapshot calls segments:

- ``torch``: the segments themselves (``segment_alloc`` / ``segment_free``);
- ``expandable``: runs of mapped blocks (``segment_map`` / ``segment_unmap``);
- ``npu_pool`` with VMM: the mapped pages of the arena (2 MiB on the simulated
  device), tracked from the placements: an allocation maps the pages it touches,
  ``empty_cache`` unmaps every whole page inside a free block.

``Simulation.exact`` says whether the tracked ranges always summed to the pool's
reserved bytes (it is False only if a policy maps memory in a way not modelled here).
"""
from __future__ import annotations

import array
from dataclasses import dataclass, field
from typing import Any, Iterable

from .._core import ffi, lib
from ..pool import OutOfMemoryError, Pool
from ..replay import UNLIMITED
from ..trace.format import OP_ALLOC, OP_EMPTY_CACHE, OP_FREE, OP_INIT_ALLOC, OP_MARK, Trace

__all__ = ["SegmentEvent", "Simulation", "simulate", "merge_ranges", "PAGE"]

PAGE = 2 << 20  # mapping granularity of the simulated device
_INT64_MIN = -(1 << 63)


@dataclass
class SegmentEvent:
    """A change of the reserved ranges right after event ``index``."""

    index: int
    action: str  # segment_alloc, segment_free, segment_map, segment_unmap
    addr: int
    size: int
    stream: int = 0


@dataclass
class Simulation:
    """One event-by-event replay of a trace through one policy."""

    policy: str
    ok: bool
    fail_index: int  # -1 when ok
    placed: array.array  # per event: address an allocation got (0 for other events)
    reserved: array.array  # per event: reserved bytes after it
    peak_reserved: int
    peak_reserved_index: int
    segment_events: list[SegmentEvent]
    blocks: list[dict[str, Any]]  # Pool.blocks() after the last event
    ranges: list[tuple[int, int]]  # reserved (addr, size) ranges after the last event, address order
    vmm: bool  # ranges are mapped pieces of larger reservations (map/unmap), not segments
    exact: bool
    stats: dict[str, Any] = field(repr=False, default_factory=dict)


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, coalesced (start, end) intervals."""
    out: list[list[int]] = []
    for s, e in sorted(ranges):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _subtract(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Intervals of ``a`` not covered by ``b`` (both sorted and coalesced)."""
    out, j = [], 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k, cur = j, s
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


class _Row:
    """Attribute access to a ``Pool.blocks()`` dict (the fallback of ``_Ranges._blocks``)."""

    def __init__(self, d: dict[str, Any]):
        self.__dict__.update(d)


class _Ranges:
    """The reserved ranges of one pool, refreshed when its reserved bytes change."""

    def __init__(self, pool: Pool):
        self.pool = pool
        self.vmm = pool.policy != "torch" and bool(pool.stats()["vmm"])
        self.policy = pool.policy if self.vmm else "torch"  # without VMM every policy holds whole segments
        self.ivs: list[tuple[int, int]] = []  # (start, end), sorted
        self.streams: dict[int, int] = {}  # segment start -> stream (torch)
        self._buf = ffi.new("np_block_info[]", 1024)
        self._cap = 1024

    def total(self) -> int:
        return sum(e - s for s, e in self.ivs)

    def _blocks(self) -> list[Any]:
        """The block map as raw cffi records (Pool.blocks() builds dicts: too slow to call this often)."""
        n = ffi.new("size_t *")
        while True:
            rc = lib.np_blocks(self.pool.ctx, self._buf, self._cap, n)
            if rc != lib.NP_OK:
                return [_Row(b) for b in self.pool.blocks()]
            if n[0] <= self._cap:
                return [self._buf[i] for i in range(n[0])]
            self._cap = 2 * n[0]
            self._buf = ffi.new("np_block_info[]", self._cap)

    def refresh(self, grew: bool, last_ptr: int) -> None:
        """Recompute after a change of reserved bytes (``grew``: it went up after allocating ``last_ptr``)."""
        if self.policy == "torch":
            segs: dict[int, tuple[int, int]] = {}
            for b in self._blocks():
                if b.segment not in segs:
                    segs[b.segment] = (b.segment_size, b.stream)
            self.streams = {a: (st if st != _INT64_MIN else 0) for a, (_, st) in segs.items()}
            self.ivs = sorted((a, a + size) for a, (size, _) in segs.items())
        elif self.policy == "npu_pool":
            if grew and last_ptr:
                size = self.pool.block_size(last_ptr)
                lo, hi = last_ptr // PAGE * PAGE, -(-(last_ptr + size) // PAGE) * PAGE
                self.ivs = merge_ranges(self.ivs + [(lo, hi)])
            else:
                holes = []
                for b in self._blocks():
                    if not b.allocated:
                        lo, hi = -(-b.addr // PAGE) * PAGE, (b.addr + b.size) // PAGE * PAGE
                        if hi > lo:
                            holes.append((lo, hi))
                self.ivs = _subtract(self.ivs, merge_ranges(holes))
        else:
            self.ivs = merge_ranges((b.addr, b.addr + b.size) for b in self._blocks() if b.mapped)

    def diff(self, before: list[tuple[int, int]], index: int, out: list[SegmentEvent]) -> None:
        """Append the segment events that turn ``before`` into the current ranges."""
        if self.vmm:
            for s, e in _subtract(self.ivs, before):
                out.append(SegmentEvent(index, "segment_map", s, e - s))
            for s, e in _subtract(before, self.ivs):
                out.append(SegmentEvent(index, "segment_unmap", s, e - s))
            return
        old, new = dict(before), dict(self.ivs)
        for s in sorted(old.keys() - new.keys()):
            out.append(SegmentEvent(index, "segment_free", s, old[s] - s))
        for s in sorted(new.keys() - old.keys()):
            out.append(SegmentEvent(index, "segment_alloc", s, new[s] - s, self.streams.get(s, 0)))


def simulate(trace: Trace, policy: str, capacity: int = UNLIMITED, *, hints: str = "markers",
             **pool_kwargs: Any) -> Simulation:
    """Replay ``trace`` through a fresh ``policy`` pool, recording reserved bytes and ranges per event.

    ``hints``: ``"markers"`` (as :func:`npu_pool.replay.run` by default), ``"sites"``
    (markers and the trace's sites) or ``"none"``. A request the device cannot serve ends
    the replay (``ok`` False).
    """
    if hints not in ("markers", "sites", "none"):
        raise ValueError(f"simulate supports hints 'markers', 'sites' and 'none', not {hints!r}")
    use_marks, use_sites = hints != "none", hints == "sites"
    n = len(trace)
    placed = array.array("Q", bytes(8 * n))
    reserved = array.array("Q", bytes(8 * n))
    events: list[SegmentEvent] = []
    ok, fail = True, -1
    ptrs: dict[int, int] = {}
    with Pool(policy, capacity=capacity, **pool_kwargs) as pool:
        ctx = pool.ctx
        st = ffi.new("np_stats *")
        ranges = _Ranges(pool)
        exact = True
        last = peak = 0
        peak_at = -1
        for i, (op, cat, site, id_, size, stream) in enumerate(
                zip(trace.op, trace.cat, trace.site, trace.id, trace.size, trace.stream)):
            p = 0
            if op == OP_ALLOC or op == OP_INIT_ALLOC:
                try:
                    p = pool.malloc(size, stream, "long" if op == OP_INIT_ALLOC else "auto",
                                    site if use_sites else -1)
                except OutOfMemoryError:
                    ok, fail = False, i
                    break
                ptrs[id_] = placed[i] = p
            elif op == OP_FREE:
                pool.free(ptrs.pop(id_))
            elif op == OP_MARK:
                if use_marks:
                    pool.mark(cat, id_)
            elif op == OP_EMPTY_CACHE:
                pool.empty_cache()
            lib.np_get_stats(ctx, st)
            cur = st.total.reserved.current
            if cur != last:
                before = ranges.ivs
                ranges.refresh(cur > last, p)
                ranges.diff(before, i, events)
                exact = exact and ranges.total() == cur
                last = cur
                if cur > peak:
                    peak, peak_at = cur, i
            reserved[i] = cur
        blocks = pool.blocks()
        stats = pool.stats()
    return Simulation(policy=policy, ok=ok, fail_index=fail, placed=placed, reserved=reserved, peak_reserved=peak,
                      peak_reserved_index=peak_at, segment_events=events, blocks=blocks, ranges=[
                          (s, e - s) for s, e in ranges.ivs], vmm=ranges.vmm, exact=exact, stats=stats)
