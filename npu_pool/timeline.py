"""A replay told by the core's own event history: reserved bytes after every trace event, the
segment changes, and the memory's segments at the end.

:func:`timeline` is :func:`npu_pool.replay.run` (the same C loop, the same figures) with the
pool's history on: the core records allocations, frees, segments allocated, mapped, unmapped
and freed, memory it keeps mapped nowhere (hold, unhold: spare chunks, memory the device refused
to take back), and failed requests, each stamped with the trace event that caused it. Timelines,
reports and memory_viz exports read that record; nothing models a policy a second time.
"""
from __future__ import annotations

import array
from dataclasses import dataclass, field
from typing import Any

from .replay import UNLIMITED, run
from .trace.format import Trace

__all__ = ["Timeline", "timeline", "SEGMENT_EVENTS"]

_GROW = ("segment_alloc", "segment_map", "hold")
SEGMENT_EVENTS = ("segment_alloc", "segment_map", "segment_free", "segment_unmap")
_RESERVED_EVENTS = SEGMENT_EVENTS + ("hold", "unhold")  # the reserved bytes are their sum


@dataclass
class Timeline:
    """One replay of a trace through one policy, as the core recorded it."""

    policy: str
    ok: bool
    fail_index: int                       # the trace event that could not be served; -1 when ok
    reserved: array.array                 # per trace event: reserved bytes after it
    peak_reserved: int
    peak_reserved_index: int              # first trace event at the peak (-1: nothing reserved)
    segment_events: list[dict[str, Any]]  # segment_alloc/free/map/unmap; "time" = trace event index
    blocks: list[dict[str, Any]]          # Pool.blocks() at the end
    ranges: list[tuple[int, int]]         # Pool.mapped_ranges() at the end
    stats: dict[str, Any] = field(repr=False, default_factory=dict)
    events: list[dict[str, Any]] = field(repr=False, default_factory=list)  # the whole history

    @property
    def pool_names(self) -> tuple[str, ...]:
        return tuple(self.stats.get("pools", ()))


def timeline(trace: Trace, policy: str, capacity: int = UNLIMITED, *, hints: str = "markers",
             plan: Any = None) -> Timeline:
    """Replay ``trace`` through a fresh ``policy`` pool with its history on. A request the device
    cannot serve ends the replay (``ok`` False, ``fail_index`` that event)."""
    r = run(trace, policy, capacity, hints=hints, plan=plan, history=True)
    assert r.history is not None and r.blocks is not None and r.ranges is not None
    end = len(trace) if r.ok else r.fail_index
    reserved = array.array("Q", bytes(8 * len(trace)))
    segs = []
    cur = peak = 0
    peak_at, at = -1, 0  # reserved[:at] is written
    for e in r.history:
        if e["kind"] not in _RESERVED_EVENTS:
            continue
        t = e["time"]
        while at < t:
            reserved[at] = cur
            at += 1
        cur += e["size"] if e["kind"] in _GROW else -e["size"]
        if e["kind"] in SEGMENT_EVENTS:
            segs.append(e)
        if cur > peak:
            peak, peak_at = cur, t
    while at < end:
        reserved[at] = cur
        at += 1
    return Timeline(policy=policy, ok=r.ok, fail_index=-1 if r.ok else end, reserved=reserved, peak_reserved=peak,
                    peak_reserved_index=peak_at, segment_events=segs, blocks=r.blocks, ranges=r.ranges,
                    stats=r.stats, events=r.history)
