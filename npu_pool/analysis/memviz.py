"""Export traces as PyTorch memory snapshots (the pickles ``torch.cuda._memory_viz`` and
https://pytorch.org/memory_viz open).

A snapshot is ``{"segments": [...], "device_traces": [[event, ...], ...]}``:
``segments`` is the allocator state at the end (each with its ``blocks``),
``device_traces`` the events per device (``alloc``, ``free_requested``,
``free_completed``, ``segment_alloc``/``segment_free`` or, for memory mapped piece
by piece, ``segment_map``/``segment_unmap``, and ``oom``).

Two sources of addresses:

- ``policy`` = a policy (``torch``, ``expandable``, ``npu_pool``; not ``planned``, which needs
  a plan: ``npu-pool replay --policy planned`` plans and replays): the trace replayed through
  it on the simulated device with the core's history on
  (:func:`npu_pool.timeline.timeline`); the events are what the core recorded and the
  segments its end state, written by :mod:`npu_pool.snapshot` as for a live pool;
- ``policy`` = ``recorded``: the trace's own addresses and segment events (an imported
  snapshot, exported back).

Event ``size`` is the requested size; ``time_us`` is the event index (traces carry
no clock). Phase markers become ``external_annotations`` (START/END pairs).

:func:`export` writes the snapshot as it is made: the trace entries stream from the core's
compact history (or the trace's columns) into the file, so memory stays a small multiple
of the trace, whatever its length (``benchmarks/io_memory.py`` measures it).
"""
from __future__ import annotations

import bisect
import heapq
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from .. import snapshot as _snap
from ..progress import ByteProgress
from ..pool import POLICIES as _POOL_POLICIES
from ..replay import NEEDS_PLAN
from ..timeline import timeline
from ..trace.format import (OP_ALLOC, OP_FREE, OP_INIT_ALLOC, OP_INIT_SEGMENT, OP_MARK, OP_OOM, OP_SEG_FREE, OP_SEG_HINT,
                            Trace, TraceError)
from ..trace.segment_map import SegmentMap
from ..vocab import ROUND, SITE_FILE

_BAR_EVENTS = 1 << 20  # traces of this many events or more show a bar while they are exported

__all__ = ["POLICIES", "snapshot_of", "snapshot_replayed", "snapshot_recorded", "write_snapshot", "site_frames",
           "export", "Exported"]

POLICIES = tuple(p for p in _POOL_POLICIES if p != "planned") + ("recorded",)


# A site's frames as exported: the innermost few, each name cut (an .npt's site strings are not
# bounded: one of 1 MB and 250,000 parts, exported once per 8,192 events, wrote 101 MB).
SITE_FRAMES, SITE_TEXT = 16, 200


def site_frames(name: str | None) -> list[dict[str, Any]]:
    """Frames (innermost first) for a site string: ``dir/file.py:12:fn < ...`` or a captured op path
    (at most SITE_FRAMES of them, each text at most SITE_TEXT characters: its end for a file)."""
    if not name:
        return []
    frames = []
    for part in name.split(" < ", SITE_FRAMES)[:SITE_FRAMES]:
        bits = part.rsplit(":", 2)
        if len(bits) == 3 and bits[1].isdigit() and len(bits[1]) < 10:
            frames.append({"filename": bits[0][-SITE_TEXT:], "line": int(bits[1]), "name": bits[2][:SITE_TEXT]})
        else:
            frames.append({"filename": SITE_FILE, "line": 0, "name": part[:SITE_TEXT]})
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
    """The trace's markers as START/END annotations (whatever hints the replay used)."""
    marks = ({"kind": "mark", "site": cat, "stream": id_, "time": i}
             for i, (op, cat, id_) in enumerate(zip(trace.op, trace.cat, trace.id)) if op == OP_MARK)
    return _snap.annotations(marks, device)


def _replayed_parts(trace: Trace, policy: str, device: int,
                    hints: str) -> tuple[Iterator[dict[str, Any]], Callable[[], dict], int]:
    """(trace entries, one at a time; the rest of the snapshot, once they ran out; the trace event
    the replay could not serve, -1 when it served all) of ``trace`` replayed through ``policy``."""
    tl = timeline(trace, policy, hints=hints)
    frames = _Frames(trace)
    sites = trace.site
    made_at: dict[int, int] = {}  # address -> the trace event of the last allocation there

    def noted(events: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for e in events:
            if e["kind"] == "alloc":
                made_at[e["addr"]] = e["time"]
            yield e

    def site(e: dict[str, Any]) -> list[dict[str, Any]]:
        return frames(sites[e["time"]]) if e["time"] < len(sites) else []

    def with_site(b: dict[str, Any]) -> dict[str, Any]:
        # a block's frames: its allocation's site in the trace (the pool keeps one only when it was
        # told the sites, --hints sites; under the phase markers every block's was -1)
        at = made_at.get(b["addr"], -1)
        return dict(b, site=sites[at]) if b["allocated"] and 0 <= at < len(sites) else b

    def rest() -> dict:
        return {"segments": _snap.segments([with_site(b) for b in tl.blocks], tl.ranges, device, tl.pool_names,
                                           frames, _snap.segment_streams(tl.segment_events)),
                "external_annotations": _annotations(trace, device),
                "allocator_settings": {"npu_pool_policy": policy, "expandable_segments": bool(tl.stats.get("vmm")),
                                       "round_size": ROUND}}

    entries = _snap.iter_device_trace(_with_recorded_failures(noted(tl.events), trace), site)
    return entries, rest, -1 if tl.ok else tl.fail_index


def _with_recorded_failures(events: Iterable[dict[str, Any]], trace: Trace) -> Iterator[dict[str, Any]]:
    """The core's events, and among them, at its trace event, each request the recorded run could
    not serve (``OP_OOM``; its ``device_free`` from ``meta["ooms"]``): a replay passes over those
    (nobody served them), and the file keeps them as the recorded run's ``oom`` entries."""
    free = {o["event"]: o["device_free"] for o in trace.ooms()}
    failures = ({"kind": "oom", "addr": 0, "size": trace.size[i], "stream": trace.stream[i], "time": i,
                 "device_free": free.get(i, 0)} for i, op in enumerate(trace.op) if op == OP_OOM)
    return heapq.merge(events, failures, key=lambda e: e["time"])


def snapshot_replayed(trace: Trace, policy: str, device: int = 0, devices: int = 1, *,
                      hints: str = "markers") -> dict[str, Any]:
    """Snapshot of ``trace`` replayed through ``policy``: the core's events (every allocation,
    free, segment change and the failed request, if any) and its memory at the end."""
    entries, rest, _ = _replayed_parts(trace, policy, device, hints)
    traces: list[list[dict[str, Any]]] = [[] for _ in range(devices)]
    traces[device] = list(entries)
    return dict(rest(), device_traces=traces)


class _Recorded:
    """The trace's own addresses: its entries (iterate once), then the end state they leave."""

    def __init__(self, trace: Trace, device: int) -> None:
        if not any(a for op, a in zip(trace.op, trace.addr) if op == OP_ALLOC):
            raise TraceError("the trace has no recorded addresses (a capture, not an imported snapshot); "
                             "export it replayed under a policy instead")
        self.trace, self.device, self.frames = trace, device, _Frames(trace)
        # expandable segments: the recorded run mapped and unmapped ranges piece by piece (an unmap
        # may cut a range, a block may span two mapped pieces), else it made and freed whole segments
        self.expandable = trace.meta.get("expandable_segments") is True
        self.segs = SegmentMap(x for op, a, n in zip(trace.op, trace.addr, trace.size)
                               if op in (OP_INIT_SEGMENT, OP_SEG_HINT, OP_SEG_FREE) for x in (a, a + n))
        self.live: dict[int, tuple[int, int, int]] = {}  # id -> (addr, size, site)
        self.done = False

    def _add(self, addr: int, size: int, stream: int, pool: int) -> None:
        if self.expandable:
            self.segs.add_range(addr, size, stream)
        else:
            self.segs.put(addr, (size, stream, pool))  # (one overlapping a segment there is left out)

    def entries(self) -> Iterator[dict[str, Any]]:
        segs, live, frames = self.segs, self.live, self.frames
        made, gone = ("segment_map", "segment_unmap") if self.expandable else ("segment_alloc", "segment_free")
        device_free = {o["event"]: o["device_free"] for o in self.trace.ooms()}
        for i, (op, cat, site, id_, size, stream, addr) in enumerate(self.trace.events()):
            if op == OP_INIT_SEGMENT:
                self._add(addr, size, stream, cat)
            elif op == OP_INIT_ALLOC:
                live[id_] = (addr, size, site)
            elif op == OP_ALLOC:
                live[id_] = (addr, size, site)
                yield _event("alloc", addr, size, stream, i, frames(site))
            elif op == OP_FREE:
                a, _, _ = live.pop(id_, (addr, size, site))
                fr = frames(site)
                yield _event("free_requested", a, size, stream, i, fr)
                yield _event("free_completed", a, size, stream, i, fr)
            elif op == OP_SEG_HINT:
                self._add(addr, size, stream, cat)
                yield _event(made, addr, size, stream, i)
            elif op == OP_SEG_FREE:
                if self.expandable:
                    segs.remove_range(addr, size)
                else:
                    size, stream, _ = segs.pop(addr) or (size, stream, 0)
                yield _event(gone, addr, size, stream, i)
            elif op == OP_OOM:  # a request the recorded run could not serve
                yield dict(_event("oom", 0, size, stream, i, frames(site)), device_free=device_free.get(i, 0))
        self.done = True

    def rest(self) -> dict[str, Any]:
        """Segments (the end state), annotations and settings; after :meth:`entries` ran out."""
        assert self.done, "the entries must be read first"
        segs, live, frames, device = self.segs.segs, self.live, self.frames, self.device
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
                    bl.append(_snap.block_entry(cur, a - cur, 0, False, []))
                nxt = mine[n + 1][1] if n + 1 < len(mine) else start + size
                bsize = min(-(-max(req, 1) // ROUND) * ROUND, max(nxt, a + req) - a, start + size - a)
                bl.append(_snap.block_entry(a, bsize, min(req, bsize), True, frames(site)))
                cur = a + bsize
            if cur < start + size:
                bl.append(_snap.block_entry(cur, start + size - cur, 0, False, []))
            segments.append(_snap.segment_entry(device, start, size, stream, "small" if pool == 0 else "large",
                                                self.expandable, bl))
        return {"segments": segments, "external_annotations": _annotations(self.trace, device),
                "allocator_settings": {"npu_pool_policy": "recorded"}}


def snapshot_recorded(trace: Trace, device: int = 0, devices: int = 1) -> dict[str, Any]:
    """Snapshot from the trace's own recorded addresses and segment events."""
    rec = _Recorded(trace, device)
    traces: list[list[dict[str, Any]]] = [[] for _ in range(devices)]
    traces[device] = list(rec.entries())
    return dict(rec.rest(), device_traces=traces)


def _check_policy(policy: str) -> None:
    if policy == "planned":
        raise ValueError(NEEDS_PLAN)
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")


def snapshot_of(traces: list[Trace], policy: str, *, hints: str = "markers") -> dict[str, Any]:
    """One snapshot for the traces of one process: trace ``k`` becomes device ``meta['device']`` (or ``k``)."""
    _check_policy(policy)
    devs = _devices(traces)
    n = max(devs) + 1 if devs else 1
    out: dict[str, Any] = {"segments": [], "device_traces": [[] for _ in range(n)], "external_annotations": []}
    for dev, t in zip(devs, traces):
        if policy == "recorded":
            snap = snapshot_recorded(t, dev, n)
        else:
            snap = snapshot_replayed(t, policy, dev, n, hints=hints)
        out["segments"].extend(snap["segments"])
        out["device_traces"][dev] = snap["device_traces"][dev]
        out["external_annotations"].extend(snap["external_annotations"])
        out["allocator_settings"] = snap["allocator_settings"]
    return out


def _devices(traces: list[Trace]) -> list[int]:
    """The device each trace becomes: ``meta['device']`` (or its position when they clash)."""
    devs = [t.meta["device"] if isinstance(t.meta.get("device"), int) and not isinstance(t.meta["device"], bool)
            and 0 <= t.meta["device"] < 1 << 16 else k for k, t in enumerate(traces)]
    return devs if len(set(devs)) == len(devs) else list(range(len(traces)))


write_snapshot = _snap.write  # pickle a snapshot (plain data only, so restricted unpicklers read it back)


class Exported:
    """What :func:`export` wrote: the file, trace entries, segments and bytes they reserve, and
    the replays that stopped at a request the simulated device could not serve ({device: event})."""

    def __init__(self, path: Path) -> None:
        self.path, self.entries, self.segments, self.reserved = path, 0, 0, 0
        self.failed: dict[int, int] = {}


def export(traces: list[Trace], policy: str, path: str | Path, *, hints: str = "markers") -> Exported:
    """Write the snapshot :func:`snapshot_of` makes straight to ``path``, streaming the trace
    entries (whole or absent: :mod:`npu_pool.outputs`). One trace is replayed at a time."""
    _check_policy(policy)
    devs = _devices(traces)
    n = max(devs) + 1 if devs else 1
    by_dev = dict(zip(devs, traces))
    out = Exported(Path(path))
    rest: dict[str, Any] = {"segments": [], "external_annotations": [], "allocator_settings": {}}
    events = sum(len(t) for t in traces)  # (entries: the events and the segments' own; no total shown)
    bar = ByteProgress("export", None, enabled=None if events >= _BAR_EVENTS else False, unit="entry")

    def one(dev: int) -> Iterator[dict[str, Any]]:
        t = by_dev.get(dev)
        if t is None:
            return
        if policy == "recorded":
            rec = _Recorded(t, dev)
            entries: Iterator[dict[str, Any]] = rec.entries()
            finish = rec.rest
        else:
            entries, finish, failed = _replayed_parts(t, policy, dev, hints)
            if failed >= 0:
                out.failed[dev] = failed
        for e in entries:
            out.entries += 1
            if not out.entries % 16384:
                bar.to(out.entries)
            yield e
        part = finish()
        rest["segments"].extend(part["segments"])
        rest["external_annotations"].extend(part["external_annotations"])
        rest["allocator_settings"] = part["allocator_settings"]

    if policy == "recorded":  # refuse a trace without addresses before anything is written
        for t in traces:
            _Recorded(t, 0)
    try:
        _snap.write_parts(path, (one(dev) for dev in range(n)), rest)
    finally:
        bar.close()
    out.segments = len(rest["segments"])
    out.reserved = sum(s["total_size"] for s in rest["segments"])
    return out
