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

import bisect
import io
import pickle
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator, Mapping, Optional

from .outputs import output
from .vocab import MARK_NAMES, ROUND, STREAM_TAGS, device_stream

__all__ = ["pool_snapshot", "segments", "device_trace", "iter_device_trace", "annotations", "write", "write_parts",
           "Frames", "block_entry", "segment_entry"]

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
             pool_names: tuple[str, ...] = ("", ""), frames_of_site: Optional[Callable[[int], list]] = None,
             range_streams: Optional[dict[int, int]] = None) -> list[dict[str, Any]]:
    """Snapshot ``segments``: one per mapped ``(addr, size)`` range, the blocks clipped to it;
    its stream is the one the range's map (or segment) event names (``range_streams``: by the
    range's first byte, :func:`segment_streams`), else its first block's: memory_viz merges the
    ranges of one stream only.

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
            if (alloc or b.get("tagged")) and stream is None and b["stream"] not in STREAM_TAGS:
                stream = b["stream"]  # the stream the memory is kept for (a tag of several streams is none)
            pool, vmm = b["pool"], bool(b.get("vmm", False))
            k += 1
        covered = sum(b["size"] for b in bl)
        if covered < size:  # a range not tiled by blocks cannot happen; keep the accounting whole if it does
            bl.append(block_entry(start + covered, size - covered, 0, False, []))
        kind = "small" if pool < len(pool_names) and pool_names[pool] == "small" else "large"
        stream = (range_streams or {}).get(start, stream)
        out.append(segment_entry(device, start, size, stream or 0, kind, vmm, bl))
    return out


def _segment_stream(e: dict[str, Any]) -> int:
    """The stream a segment event of a pool's history stands for (one arena of every stream's: 0)."""
    return 0 if e.get("pool", 0) > 1 else device_stream(int(e["stream"]))


def segment_streams(events: Iterable[dict[str, Any]]) -> dict[int, int]:
    """The stream of each range a pool's history maps or allocates, by its first byte (the latest)."""
    return {int(e["addr"]): _segment_stream(e) for e in events if e["kind"] in ("segment_alloc", "segment_map")}


def device_trace(events: Iterable[dict[str, Any]], frames: Frames = _NO_FRAMES) -> list[dict[str, Any]]:
    """PyTorch TraceEntry dicts for a pool's history (markers, cache releases, holds and compact
    events are left out: PyTorch's trace has no action for them)."""
    return list(iter_device_trace(events, frames))


_BUCKET = 21  # alloc entries indexed by their first byte >> _BUCKET (2 MiB) at least (_Index)


def iter_device_trace(events: Iterable[dict[str, Any]], frames: Frames = _NO_FRAMES) -> Iterator[dict[str, Any]]:
    """:func:`device_trace`, one entry at a time.

    Memory can be unmapped under tensors that stay allocated: a paused tag's (docs/colocated.md),
    and a chunk a compaction replaces, for a moment (docs/api.md, Compaction). PyTorch's tools
    know no allocation outside device memory, so such a tensor leaves the device with it: freed at
    the unmap of any of its bytes, and allocated again at the map that leaves none of them
    unmapped, as an allocator that offloads it shows it. (What the history unmapped is known from
    its own events: memory mapped before its first one counts as mapped.)"""
    live = _Index()    # on the device
    paused = _Index()  # allocated, some of its bytes unmapped
    unmapped = _Ranges()
    for e in events:
        kind = e["kind"]
        base = {"addr": int(e["addr"]), "size": int(e["size"]), "stream": device_stream(int(e["stream"])),
                "time_us": int(e["time"])}
        if kind == "alloc":
            entry = dict(base, action="alloc", frames=frames(e))
            live.add(entry)
            yield entry
        elif kind == "free":
            if live.drop(base["addr"]) or not paused.drop(base["addr"]):  # (one off the device left it at the unmap)
                fr = frames(e)
                yield dict(base, action="free_requested", frames=fr)
                yield dict(base, action="free_completed", frames=fr)
        elif kind in ("segment_alloc", "segment_free", "segment_map", "segment_unmap"):
            entry = dict(base, action=kind, stream=_segment_stream(e), frames=[])
            if kind == "segment_unmap":
                unmapped.add(base["addr"], base["size"])
                for b in live.take(base["addr"], base["size"]):
                    paused.add(b)
                    left = {k: b[k] for k in ("addr", "size", "stream", "frames")}
                    yield dict(left, action="free_requested", time_us=base["time_us"])
                    yield dict(left, action="free_completed", time_us=base["time_us"])
                yield entry
                continue
            if kind != "segment_free":
                unmapped.remove(base["addr"], base["size"])
            yield entry
            if kind == "segment_map":
                for b in paused.take(base["addr"], base["size"], lambda b: not unmapped.overlaps(b["addr"], _end(b))):
                    live.add(b)
                    yield dict(b, time_us=base["time_us"])
        elif kind == "oom":
            free = int(e["device_free"])  # (UINT64_MAX: the device did not say)
            yield dict(base, action="oom", addr=0, device_free=0 if free == (1 << 64) - 1 else free, frames=frames(e))


def _end(b: dict[str, Any]) -> int:
    return b["addr"] + max(b["size"], 1)


class _Index:
    """Alloc entries by their first byte, in tiers by size: tier ``s`` holds those of at most
    ``2**s`` bytes (``s >= _BUCKET``) in buckets of ``2**s`` bytes, so that one reaching into a
    range from below starts at most one bucket of its tier before the range's first. (Bucketed by
    first byte alone, a range had to look back as far as the longest entry the history held: one
    large tensor, and every unmap walked the entries of gigabytes below it.)"""

    def __init__(self) -> None:
        self.tiers: dict[int, dict[int, dict[int, dict[str, Any]]]] = {}  # s -> bucket -> addr -> entry
        self.tier_of: dict[int, int] = {}  # addr -> s

    def add(self, entry: dict[str, Any]) -> None:
        a = entry["addr"]
        s = max(_BUCKET, (max(entry["size"], 1) - 1).bit_length())
        self.tiers.setdefault(s, {}).setdefault(a >> s, {})[a] = entry
        self.tier_of[a] = s

    def drop(self, addr: int) -> bool:
        """Remove the entry at ``addr``; whether it was there."""
        s = self.tier_of.pop(addr, None)
        if s is None:
            return False
        tier = self.tiers[s]
        held = tier[addr >> s]
        del held[addr]
        if not held:
            del tier[addr >> s]
            if not tier:
                del self.tiers[s]
        return True

    def take(self, addr: int, size: int,
             keep: Callable[[dict[str, Any]], bool] = lambda b: True) -> list[dict[str, Any]]:
        """Remove and return (in address order) the entries that share a byte with
        [addr, addr + size) and pass ``keep``."""
        end = addr + max(size, 1)
        out = []
        for s, tier in list(self.tiers.items()):
            lo, hi = max(0, addr - (1 << s) + 1) >> s, (end - 1) >> s
            buckets = range(lo, hi + 1) if hi - lo < len(tier) else sorted(k for k in tier if lo <= k <= hi)
            for bucket in buckets:
                held = tier.get(bucket)
                for a in [a for a, b in held.items() if a < end and _end(b) > addr and keep(b)] if held else ():
                    out.append(held.pop(a))
                    del self.tier_of[a]
                if held is not None and not held:
                    del tier[bucket]
            if not tier:
                del self.tiers[s]
        return sorted(out, key=lambda b: b["addr"])


class _Ranges:
    """Disjoint byte ranges, sorted (the memory a history unmapped and has not mapped again)."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def add(self, addr: int, size: int) -> None:
        lo, hi = addr, addr + size
        i, j = bisect.bisect_left(self.ends, lo), bisect.bisect_right(self.starts, hi)  # [i, j): touching
        if i < j:
            lo, hi = min(lo, self.starts[i]), max(hi, self.ends[j - 1])
        self.starts[i:j], self.ends[i:j] = [lo], [hi]

    def remove(self, addr: int, size: int) -> None:
        lo, hi = addr, addr + size
        i, j = bisect.bisect_right(self.ends, lo), bisect.bisect_left(self.starts, hi)  # [i, j): overlapping
        if i >= j:
            return
        starts = [self.starts[i]] if self.starts[i] < lo else []
        ends = [lo] if starts else []
        if self.ends[j - 1] > hi:
            starts.append(hi)
            ends.append(self.ends[j - 1])
        self.starts[i:j], self.ends[i:j] = starts, ends

    def overlaps(self, lo: int, hi: int) -> bool:
        i = bisect.bisect_right(self.ends, lo)
        return i < len(self.starts) and self.starts[i] < hi


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
                  frames_of_site: Optional[Callable[[int], list]] = None, *,
                  history_limit: Optional[int] = None, devices: int = 0,
                  views: Optional[Mapping[int, Any]] = None) -> dict[str, Any]:
    """One snapshot of the pools of a process, ``{device: pool}``, from their block maps,
    mapped ranges and histories, each pool read at one instant (``Pool.view``; ``history_limit``:
    only each pool's latest events; ``views``: ``{device: view}`` already read); its
    ``device_traces`` has one list per device, at least ``devices`` (torch's: one per device the
    process sees, those that served nothing empty)."""
    n = max(max(pools, default=-1) + 1, devices)
    snap: dict[str, Any] = {"segments": [], "device_traces": [[] for _ in range(n)], "external_annotations": []}
    policies, vmm = set(), False
    unmapped: dict[int, int] = {}
    for device, pool in sorted(pools.items()):
        # (one instant: other threads may allocate meanwhile)
        st, blocks, ranges, events = views[device] if views and device in views else pool.view(history_limit)
        names = tuple(st["pools"])
        segs = segments(blocks, ranges, device, names, frames_of_site, segment_streams(events))
        snap["segments"] += segs
        # reserved memory at no address: spare chunks, memory the device refused to take back
        held = st["total"]["reserved"]["current"] - sum(s["total_size"] for s in segs)
        if held > 0:
            unmapped[device] = held
        snap["device_traces"][device] = device_trace(events, frames)
        snap["external_annotations"] += annotations(events, device)
        policies.add(st["policy"])
        vmm = bool(st["vmm"])
    snap["allocator_settings"] = {"npu_pool_policy": ",".join(sorted(policies)),
                                  "expandable_segments": vmm, "round_size": ROUND,
                                  "npu_pool_unmapped_bytes": unmapped}  # (segments + these = memory_reserved())
    kinds = {pool.device_rules for pool in pools.values()}
    if len(kinds) == 1:  # whose request rules a replay of it applies (trace.snapshot reads it)
        snap["allocator_settings"]["device_type"] = kinds.pop()
    return snap


def write(snapshot: dict[str, Any], path: str | Path) -> Path:
    """Pickle ``snapshot`` (plain data only, so restricted unpicklers read it back); the file
    is whole or absent (:mod:`npu_pool.outputs`)."""
    traces = snapshot.get("device_traces", [])
    rest = {k: v for k, v in snapshot.items() if k != "device_traces"}
    return write_parts(path, [iter(t) for t in traces], rest)


_BATCH = 8192  # trace entries pickled at a time: the memory the writer needs beyond one entry


def _fragment(obj: Any) -> bytes:
    """``obj`` pickled (protocol 2, so no framing) without the protocol header and STOP."""
    buf = io.BytesIO()
    pickle.Pickler(buf, protocol=2).dump(obj)
    return buf.getbuffer()[2:-1].tobytes()


def _append_batch(f: IO[bytes], batch: list[dict[str, Any]]) -> None:
    """Append ``batch``'s items to the list on top of the unpickler's stack: the batch pickled
    as a list, its list-creating opcodes (EMPTY_LIST, BINPUT) dropped. Each batch is pickled
    by a fresh pickler: its memo indices restart at 0 and only its own opcodes refer to them."""
    body = _fragment(batch)
    skip = 1 + (2 if body[1:2] == pickle.BINPUT else 5 if body[1:2] == pickle.LONG_BINPUT else 0)
    assert body[:1] == pickle.EMPTY_LIST and skip > 1, "unexpected pickle of a list"
    f.write(body[skip:])


def write_parts(path: str | Path, device_traces: Iterable[Iterable[dict[str, Any]]],
                rest: Mapping[str, Any]) -> Path:
    """Write a snapshot whose ``device_traces`` come one entry at a time: memory stays bounded
    by :data:`_BATCH` entries and ``rest`` (segments, annotations, settings; small) whatever
    the length of the traces. The file reads back with ``pickle.load`` as the dict
    ``{"device_traces": [...], **rest}``; it is whole or absent (:mod:`npu_pool.outputs`)."""
    p = Path(path)
    with output(p, "wb") as f:
        f.write(pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + _fragment("device_traces") + pickle.EMPTY_LIST)
        for entries in device_traces:
            f.write(pickle.EMPTY_LIST)
            batch: list[dict[str, Any]] = []
            for e in entries:
                batch.append(e)
                if len(batch) == _BATCH:
                    _append_batch(f, batch)
                    batch = []
            if batch:
                _append_batch(f, batch)
            f.write(pickle.APPEND)  # this device's list onto device_traces
        f.write(pickle.SETITEM)
        for key, value in rest.items():
            f.write(_fragment(key) + _fragment(value) + pickle.SETITEM)
        f.write(pickle.STOP)
    return p
