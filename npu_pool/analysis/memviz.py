"""Export traces as PyTorch memory snapshots (the pickles ``torch.cuda._memory_viz`` and
https://pytorch.org/memory_viz open).

A snapshot is ``{"segments": [...], "device_traces": [[event, ...], ...]}``:
``segments`` is the allocator state at the end (each with its ``blocks``),
``device_traces`` the events per device (``alloc``, ``free_requested``,
``free_completed``, ``segment_alloc``/``segment_free`` or, for memory mapped piece
by piece, ``segment_map``/``segment_unmap``, and ``oom``).

Two sources of addresses:

- ``policy`` = ``torch`` / ``expandable`` / ``npu_pool``: the trace replayed through that
  policy on the simulated device (:func:`npu_pool.analysis.simulate.simulate`, whose
  placements equal :func:`npu_pool.replay.run`'s ``placed``); segments come from the
  pool's block map (:meth:`npu_pool.pool.Pool.blocks`);
- ``policy`` = ``recorded``: the trace's own addresses and segment events (an imported
  snapshot, exported back).

Event ``size`` is the requested size; ``time_us`` is the event index (traces carry
no clock). Phase markers become ``external_annotations`` (START/END pairs).
"""
from __future__ import annotations

import bisect
import pickle
from pathlib import Path
from typing import Any

from ..trace.format import (MARK_NAMES, OP_ALLOC, OP_FREE, OP_INIT_ALLOC, OP_INIT_SEGMENT, OP_MARK, OP_SEG_FREE,
                            OP_SEG_HINT, Trace, TraceError)
from .simulate import Simulation, simulate

__all__ = ["POLICIES", "snapshot_of", "snapshot_from_simulation", "snapshot_recorded", "write_snapshot",
           "site_frames", "blocks_to_segments"]

POLICIES = ("torch", "expandable", "npu_pool", "recorded")
_ROUND = 512
_INT64_MIN = -(1 << 63)


def site_frames(name: str | None) -> list[dict[str, Any]]:
    """Frames (innermost first) for a site string: ``dir/file.py:12:fn < ...`` or a captured op path."""
    if not name:
        return []
    frames = []
    for part in name.split(" < "):
        bits = part.rsplit(":", 2)
        if len(bits) == 3 and bits[1].isdigit():
            frames.append({"filename": bits[0], "line": int(bits[1]), "name": bits[2]})
        else:
            frames.append({"filename": "npu_pool-site", "line": 0, "name": part})
    return frames


class _Frames:
    """Site index -> frames list, built once per site."""

    def __init__(self, trace: Trace):
        self.names = [str(s) for s in trace.meta.get("sites", [])]
        self.cache: dict[int, list[dict[str, Any]]] = {}

    def __call__(self, site: int) -> list[dict[str, Any]]:
        if site not in self.cache:
            self.cache[site] = site_frames(self.names[site]) if 0 <= site < len(self.names) else []
        return self.cache[site]


def _event(action: str, addr: int, size: int, stream: int, t: int, frames: list | None = None) -> dict[str, Any]:
    return {"action": action, "addr": int(addr), "size": int(size), "stream": int(stream), "time_us": int(t),
            "frames": frames if frames is not None else []}


def _annotations(trace: Trace, device: int) -> list[dict[str, Any]]:
    """Markers as START/END annotations; a layer marker is named ``layer <n>``."""
    out = []
    for i, (op, cat, id_) in enumerate(zip(trace.op, trace.cat, trace.id)):
        if op != OP_MARK or cat >= len(MARK_NAMES):
            continue
        mark = MARK_NAMES[cat]
        what, _, edge = mark.rpartition("_")
        stage = {"begin": "START", "enter": "START", "end": "END", "exit": "END"}.get(edge)
        if stage is None:
            continue
        name = f"{what} {id_}" if id_ >= 0 else what
        out.append({"stage": stage, "name": name, "device": device, "time_us": i})
    return out


def _segment(device: int, addr: int, size: int, stream: int, kind: str, expandable: bool,
             blocks: list[dict[str, Any]]) -> dict[str, Any]:
    allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    return {"device": device, "address": addr, "total_size": size, "allocated_size": allocated,
            "active_size": allocated, "requested_size": sum(b["requested_size"] for b in blocks),
            "stream": stream, "segment_type": kind, "segment_pool_id": (0, 0), "is_expandable": expandable,
            "frames": [], "blocks": blocks}


def _block(addr: int, size: int, requested: int, allocated: bool, frames: list) -> dict[str, Any]:
    return {"address": addr, "size": size, "requested_size": requested if allocated else 0,
            "state": "active_allocated" if allocated else "inactive", "frames": frames if allocated else []}


def blocks_to_segments(blocks: list[dict[str, Any]], ranges: list[tuple[int, int]] | None, device: int,
                       frames: _Frames | None = None, policy: str = "torch") -> list[dict[str, Any]]:
    """Snapshot ``segments`` from a :meth:`Pool.blocks` map.

    ``ranges`` None: each pool segment is a snapshot segment. Otherwise (memory
    mapped piece by piece) each reserved ``(addr, size)`` range is one expandable
    segment and blocks are clipped to it, as PyTorch reports expandable segments.
    """
    frames = frames or (lambda site: [])
    kind = {0: "small", 1: "large"} if policy == "torch" else {0: "large", 1: "large"}
    if ranges is None:
        segs: dict[int, list[dict[str, Any]]] = {}
        head: dict[int, dict[str, Any]] = {}
        for b in blocks:
            segs.setdefault(b["segment"], []).append(
                _block(b["addr"], b["size"], b["requested"], bool(b["allocated"]), frames(b["site"])))
            head.setdefault(b["segment"], b)
        return [_segment(device, a, head[a]["segment_size"], max(head[a]["stream"], 0),
                         kind.get(head[a]["pool"], "large"), False, bl) for a, bl in sorted(segs.items())]
    out = []
    ordered = sorted(blocks, key=lambda b: b["addr"])
    j = 0
    for start, size in sorted(ranges):
        end = start + size
        while j < len(ordered) and ordered[j]["addr"] + ordered[j]["size"] <= start:
            j += 1
        bl, stream = [], None
        k = j
        while k < len(ordered) and ordered[k]["addr"] < end:
            b = ordered[k]
            lo, hi = max(b["addr"], start), min(b["addr"] + b["size"], end)
            alloc = bool(b["allocated"])
            bl.append(_block(lo, hi - lo, b["requested"], alloc, frames(b["site"])))
            if alloc and stream is None:
                stream = b["stream"]
            k += 1
        covered = sum(b["size"] for b in bl)
        if covered < size:  # range not tiled by blocks (should not happen): keep the accounting whole
            bl.append(_block(start + covered, size - covered, 0, False, []))
        out.append(_segment(device, start, size, stream if stream not in (None, _INT64_MIN) else 0, "large",
                            True, bl))
    return out


def snapshot_from_simulation(trace: Trace, sim: Simulation, device: int = 0, devices: int = 1) -> dict[str, Any]:
    """Snapshot of ``trace`` as ``sim`` placed it (events of every allocation, segment changes, end state)."""
    frames = _Frames(trace)
    evs: list[dict[str, Any]] = []
    seg_events = sim.segment_events
    s = 0
    addr_of: dict[int, int] = {}
    end = sim.fail_index if not sim.ok else len(trace)
    for i in range(end):
        op = trace.op[i]
        if op == OP_ALLOC or op == OP_INIT_ALLOC:
            # the segment change an allocation caused is recorded just before it, as PyTorch orders them
            while s < len(seg_events) and seg_events[s].index == i:
                e = seg_events[s]
                evs.append(_event(e.action, e.addr, e.size, e.stream, i))
                s += 1
            a = sim.placed[i]
            addr_of[trace.id[i]] = a
            evs.append(_event("alloc", a, trace.size[i], trace.stream[i], i, frames(trace.site[i])))
        elif op == OP_FREE:
            a = addr_of.pop(trace.id[i])
            fr = frames(trace.site[i])
            evs.append(_event("free_requested", a, trace.size[i], trace.stream[i], i, fr))
            evs.append(_event("free_completed", a, trace.size[i], trace.stream[i], i, fr))
        while s < len(seg_events) and seg_events[s].index == i:
            e = seg_events[s]
            evs.append(_event(e.action, e.addr, e.size, e.stream, i))
            s += 1
    if not sim.ok:
        free = max(0, sim.stats.get("limit", 0) - sim.stats["total"]["reserved"]["current"]) if sim.stats else 0
        ev = _event("oom", 0, trace.size[end], trace.stream[end], end)
        ev["device_free"] = free
        evs.append(ev)
    segments = blocks_to_segments(sim.blocks, sim.ranges if sim.vmm else None, device, frames, sim.policy)
    traces: list[list[dict[str, Any]]] = [[] for _ in range(devices)]
    traces[device] = evs
    return {"segments": segments, "device_traces": traces, "external_annotations": _annotations(trace, device),
            "allocator_settings": {"npu_pool_policy": sim.policy, "expandable_segments": sim.vmm}}


def snapshot_recorded(trace: Trace, device: int = 0, devices: int = 1) -> dict[str, Any]:
    """Snapshot from the trace's own recorded addresses and segment events."""
    if not any(a for op, a in zip(trace.op, trace.addr) if op == OP_ALLOC):
        raise TraceError("the trace has no recorded addresses (a capture, not an imported snapshot); "
                         "export it replayed under a policy instead")
    frames = _Frames(trace)
    segs: dict[int, tuple[int, int, int]] = {}  # addr -> (size, stream, pool)
    live: dict[int, tuple[int, int, int]] = {}  # id -> (addr, size, site)
    evs: list[dict[str, Any]] = []
    for i, (op, cat, site, id_, size, stream, addr) in enumerate(trace.events()):
        if op == OP_INIT_SEGMENT:
            segs[addr] = (size, stream, cat)
        elif op == OP_INIT_ALLOC:
            live[id_] = (addr, size, site)
        elif op == OP_ALLOC:
            live[id_] = (addr, size, site)
            evs.append(_event("alloc", addr, size, stream, i, frames(site)))
        elif op == OP_FREE:
            a, _, _ = live.pop(id_, (addr, size, site))
            fr = frames(site)
            evs.append(_event("free_requested", a, size, stream, i, fr))
            evs.append(_event("free_completed", a, size, stream, i, fr))
        elif op == OP_SEG_HINT:
            segs[addr] = (size, stream, cat)
            evs.append(_event("segment_alloc", addr, size, stream, i))
        elif op == OP_SEG_FREE:
            seg_size, seg_stream, _ = segs.pop(addr, (size, stream, 0))
            evs.append(_event("segment_free", addr, seg_size, seg_stream, i))
    blocks = []
    starts = sorted(segs)
    for a, size, site in sorted(live.values()):
        k = bisect.bisect_right(starts, a) - 1
        if k < 0 or a >= starts[k] + segs[starts[k]][0]:
            continue  # outside every segment: cannot be placed in the end state
        blocks.append((starts[k], a, size, site))
    segments = []
    for start in starts:
        size, stream, pool = segs[start]
        mine = [b for b in blocks if b[0] == start]
        bl, cur = [], start
        for n, (_, a, req, site) in enumerate(mine):
            if a < cur:
                continue  # overlaps the previous block: recorded addresses disagree, keep the first
            if a > cur:
                bl.append(_block(cur, a - cur, 0, False, []))
            nxt = mine[n + 1][1] if n + 1 < len(mine) else start + size
            bsize = min(-(-max(req, 1) // _ROUND) * _ROUND, max(nxt, a + req) - a, start + size - a)
            bl.append(_block(a, bsize, min(req, bsize), True, frames(site)))
            cur = a + bsize
        if cur < start + size:
            bl.append(_block(cur, start + size - cur, 0, False, []))
        segments.append(_segment(device, start, size, stream, "small" if pool == 0 else "large", False, bl))
    traces: list[list[dict[str, Any]]] = [[] for _ in range(devices)]
    traces[device] = evs
    return {"segments": segments, "device_traces": traces, "external_annotations": _annotations(trace, device),
            "allocator_settings": {"npu_pool_policy": "recorded"}}


def snapshot_of(traces: list[Trace], policy: str, *, hints: str = "markers") -> dict[str, Any]:
    """One snapshot for the traces of one process: trace ``k`` becomes device ``meta['device']`` (or ``k``)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    devs = [int(t.meta.get("device", k)) if isinstance(t.meta.get("device", k), int) else k
            for k, t in enumerate(traces)]
    if len(set(devs)) != len(devs):
        devs = list(range(len(traces)))
    n = max(devs) + 1 if devs else 1
    out: dict[str, Any] = {"segments": [], "device_traces": [[] for _ in range(n)], "external_annotations": []}
    for dev, t in zip(devs, traces):
        if policy == "recorded":
            snap = snapshot_recorded(t, dev, n)
        else:
            sim = simulate(t, policy, hints=hints)
            snap = snapshot_from_simulation(t, sim, dev, n)
        out["segments"].extend(snap["segments"])
        out["device_traces"][dev] = snap["device_traces"][dev]
        out["external_annotations"].extend(snap["external_annotations"])
        out["allocator_settings"] = snap["allocator_settings"]
    return out


def write_snapshot(snapshot: dict[str, Any], path: str | Path) -> Path:
    """Pickle ``snapshot`` (plain data only, so restricted unpicklers read it back)."""
    p = Path(path)
    with open(p, "wb") as f:
        pickle.dump(snapshot, f, protocol=4)
    return p
