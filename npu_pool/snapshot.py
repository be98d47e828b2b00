"""PyTorch memory snapshots of npu_pool pools: what ``torch.cuda.memory._snapshot()`` returns and
https://pytorch.org/memory_viz opens, built from the core's own records.

A snapshot is ``{"segments": [...], "device_traces": [[entry, ...] per device],
"external_annotations": [...], "allocator_settings": {...}}``:

- ``segments``: the memory held at the end, one per range backed by physical memory (a
  malloc'ed segment, or a run of mapped pages of a reservation: ``is_expandable``), with
  the blocks inside it (:meth:`Pool.blocks`, :meth:`Pool.mapped_ranges`);
- ``device_traces``: the pool's event history (:meth:`Pool.history`) as PyTorch's
  TraceEntry actions: ``alloc``, ``free_requested`` + ``free_completed``, ``segment_alloc``,
  ``segment_free``, ``segment_map``, ``segment_unmap``, ``oom`` (with ``device_free``);
  ``time_us`` is the event's time (microseconds, or a replayed trace's event index);
- ``external_annotations``: phase markers as ``START``/``END`` pairs.

Works on anything with ``blocks()``, ``mapped_ranges()``, ``history()`` and ``stats()`` (a
:class:`~npu_pool.pool.Pool`): this module imports nothing above the vocabulary.
"""
from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional

from .vocab import MARK_NAMES, ROUND

__all__ = ["pool_snapshot", "segments", "device_trace", "annotations", "write", "Frames", "block_entry",
           "segment_entry"]

# site -> frames (innermost first) of an event; events of a live pool have none
Frames = Callable[[dict[str, Any]], list[dict[str, Any]]]
_NO_FRAMES: Frames = lambda event: []  # noqa: E731
_EDGES = {"begin": "START", "enter": "START", "end": "END", "exit": "END"}


def block_entry(addr: int, size: int, requested: int, allocated: bool, frames: list) -> dict[str, Any]:
    """One block of a snapshot segment."""
    return {"address": addr, "size": size, "requested_size": requested if allocated else 0,
            "state": "active_allocated" if allocated else "inactive", "frames": frames if allocated else []}


def segment_entry(device: int, addr: int, size: int, stream: int, kind: str, expandable: bool,
             blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """One snapshot segment holding ``blocks``."""
    allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    return {"device": device, "address": addr, "total_size": size, "allocated_size": allocated,
            "active_size": allocated, "requested_size": sum(b["requested_size"] for b in blocks),
            "stream": stream, "segment_type": kind, "segment_pool_id": (0, 0), "is_expandable": expandable,
            "frames": [], "blocks": blocks}


def segments(blocks: list[dict[str, Any]], ranges: Iterable[tuple[int, int]], device: int,
             pool_names: tuple[str, ...] = ("", ""), frames_of_site: Optional[Callable[[int], list]] = None
             ) -> list[dict[str, Any]]:
    """Snapshot ``segments``: one per mapped ``(addr, size)`` range, the blocks clipped to it.

    A range of a reservation (memory mapped page by page) is an expandable segment, as
    PyTorch reports expandable segments; ``segment_type`` is ``small`` for a pool named
    ``small``, else ``large``."""
    frames_of_site = frames_of_site or (lambda site: [])
    ordered = sorted(blocks, key=lambda b: b["addr"])
    out, j = [], 0
    for start, size in sorted(ranges):
        end = start + size
        while j < len(ordered) and ordered[j]["addr"] + ordered[j]["size"] <= start:
            j += 1
        bl, stream, pool, vmm = [], None, 1, False
        k = j
        while k < len(ordered) and ordered[k]["addr"] < end:
            b = ordered[k]
            lo, hi = max(b["addr"], start), min(b["addr"] + b["size"], end)
            alloc = bool(b["allocated"])
            bl.append(block_entry(lo, hi - lo, b["requested"], alloc, frames_of_site(b["site"]) if alloc else []))
            if (alloc or b.get("tagged")) and stream is None:  # the stream the memory is kept for
                stream = b["stream"]
            pool, vmm = b["pool"], bool(b.get("vmm", False))
            k += 1
        covered = sum(b["size"] for b in bl)
        if covered < size:  # a range not tiled by blocks cannot happen; keep the accounting whole if it does
            bl.append(block_entry(start + covered, size - covered, 0, False, []))
        kind = "small" if pool < len(pool_names) and pool_names[pool] == "small" else "large"
        out.append(segment_entry(device, start, size, stream or 0, kind, vmm, bl))
    return out


def device_trace(events: Iterable[dict[str, Any]], frames: Frames = _NO_FRAMES) -> list[dict[str, Any]]:
    """PyTorch TraceEntry dicts for a pool's history (markers and cache releases are left out)."""
    out: list[dict[str, Any]] = []
    for e in events:
        kind = e["kind"]
        base = {"addr": int(e["addr"]), "size": int(e["size"]), "stream": int(e["stream"]),
                "time_us": int(e["time"])}
        if kind == "alloc":
            out.append(dict(base, action="alloc", frames=frames(e)))
        elif kind == "free":
            fr = frames(e)
            out += [dict(base, action="free_requested", frames=fr), dict(base, action="free_completed", frames=fr)]
        elif kind in ("segment_alloc", "segment_free", "segment_map", "segment_unmap"):
            out.append(dict(base, action=kind, stream=0 if e.get("pool", 0) > 1 else base["stream"], frames=[]))
        elif kind == "oom":
            out.append(dict(base, action="oom", addr=0, device_free=int(e["device_free"]), frames=frames(e)))
    return out


def annotations(events: Iterable[dict[str, Any]], device: int) -> list[dict[str, Any]]:
    """Phase markers as START/END annotations (a layer marker is named ``layer <n>``)."""
    out = []
    for e in events:
        if e["kind"] != "mark" or not 0 <= e["site"] < len(MARK_NAMES):
            continue
        what, _, edge = MARK_NAMES[e["site"]].rpartition("_")
        if edge not in _EDGES:
            continue
        name = f"{what} {e['stream']}" if e["stream"] >= 0 else what
        out.append({"stage": _EDGES[edge], "name": name, "device": device, "time_us": int(e["time"])})
    return out


def pool_snapshot(pools: Mapping[int, Any], frames: Frames = _NO_FRAMES,
                  frames_of_site: Optional[Callable[[int], list]] = None) -> dict[str, Any]:
    """One snapshot of the pools of a process, ``{device: pool}``, from their block maps,
    mapped ranges and histories."""
    n = max(pools, default=-1) + 1
    snap: dict[str, Any] = {"segments": [], "device_traces": [[] for _ in range(n)], "external_annotations": []}
    policies, vmm = set(), False
    for device, pool in sorted(pools.items()):
        st = pool.stats()
        events = pool.history()
        names = tuple(st["pools"])
        snap["segments"] += segments(pool.blocks(), pool.mapped_ranges(), device, names, frames_of_site)
        snap["device_traces"][device] = device_trace(events, frames)
        snap["external_annotations"] += annotations(events, device)
        policies.add(st["policy"])
        vmm = bool(st["vmm"])
    snap["allocator_settings"] = {"npu_pool_policy": ",".join(sorted(policies)),
                                  "expandable_segments": vmm, "round_size": ROUND}
    return snap


def write(snapshot: dict[str, Any], path: str | Path) -> Path:
    """Pickle ``snapshot`` (plain data only, so restricted unpicklers read it back)."""
    p = Path(path)
    with open(p, "wb") as f:
        pickle.dump(snapshot, f, protocol=4)
    return p
