"""Import PyTorch CUDA memory snapshots (``torch.cuda.memory._dump_snapshot``) as traces.

A snapshot holds ``device_traces`` (per device, the events recorded since
``_record_memory_history`` was switched on) and ``segments`` (the allocator's state
when it was dumped). Recording usually starts mid-run, so the state at the start of
the window is rebuilt from frees without allocs, the end-state blocks and a backward
walk over segment events; see docs/trace_format.md.

The pickle is read with an unpickler that refuses every global: a snapshot is plain
dicts, lists, tuples, strings and numbers, so anything else is rejected unexecuted. Nothing
is trusted: every element the importer walks costs the file at least a byte, so a file may
not reference more elements than it has bytes (shared references cannot blow up the work),
and the recorded ``allocator_settings`` are copied with a bound on depth and size.
Sites come from each alloc's innermost Python frames, skipping torch's and the
stdlib's own files where a user frame exists.

Every action of PyTorch's TraceEntry is read: ``alloc``, ``free_requested``,
``free_completed``, ``segment_alloc``/``segment_map`` and ``segment_free``/``segment_unmap``
(segment hints), ``snapshot`` (ignored) and ``oom`` (no address: the request that failed; an
``OP_OOM`` event, its ``device_free`` in ``meta["ooms"]``). ``external_annotations`` (the
ranges of ``record_function``, e.g. ``ProfilerStep#3`` or ``Optimizer.step#AdamW.step``, and
npu_pool's own markers) become phase markers where their names say which phase
(:func:`marker_of`), placed by their time among the events.
"""
from __future__ import annotations

import bisect
import os
import pickle
import re
import reprlib
import sys
from pathlib import Path
from array import array
from itertools import islice, repeat
from typing import Any, BinaryIO, Callable, Iterable, Iterator

from .format import (CAT_UNKNOWN, MAGIC, MARK_BACKWARD_BEGIN, MARK_EVAL_BEGIN, MARK_FORWARD_BEGIN, MARK_ITER_BEGIN,
                     PLAN_MAGIC, MARK_LAYER_ENTER, MARK_OPTIMIZER_BEGIN, MARK_SETUP_BEGIN, OP_ALLOC, OP_EMPTY_CACHE,
                     OP_FREE, OP_INIT_ALLOC, OP_INIT_SEGMENT, OP_MARK, OP_OOM, OP_SEG_FREE, OP_SEG_HINT, POOL_LARGE,
                     POOL_SMALL, Trace, TraceError)
from .pickle_stream import NotStreamable, overreach, stream_dict
from .segment_map import SegmentMap
from ..inputs import NotRegularFile, open_regular
from ..progress import ByteProgress
from ..vocab import MAX_REQUEST, PROFILER_PREFIX, SITE_FILE, STREAM_TAGS, device_stream, profiled_mark

__all__ = ["load_snapshot", "snapshot_to_traces", "marker_of", "check_head"]

_SMALL_SEGMENT = 2 << 20  # the stock allocator's small-pool segment size
_SITE_FRAMES = 4  # innermost user frames kept per site
_MAX_WARNINGS = 50
_SITES_HELD = 2048  # frames (and a quarter as many sequences) a device's site cache keeps before it stops growing
_BAR_BYTES = 16 << 20  # a snapshot this large shows a bar while it is read (a terminal only): ~3 s and more
_FRAMES_PER_BYTE = 16  # frames the sites may look at per byte of file, all devices together (real snapshots: < 0.5)
_PATH_MAX = 4096  # a longer "filename" is no source file: not looked into
_LABEL = 100  # characters of a site's file (its end), name or line kept
_ACTIVE = ("active_allocated", "active_pending_free")
_SEG_NEW = ("segment_alloc", "segment_map")
_SEG_GONE = ("segment_free", "segment_unmap")
_IGNORED = ("snapshot", "free_requested")
_SETTINGS_DEPTH, _SETTINGS_VALUES = 6, 500  # how much of allocator_settings is copied into meta
# A library frame: torch's own (site-packages/torch/..., a source checkout's torch/) or the stdlib's.
_LIB_FRAME = re.compile(r"(?:^|[\\/])torch[\\/]|[\\/]python3(?:\.\d+)?[\\/](?!site-packages|dist-packages)[^\\/]+\.py$")


class _RefusedGlobal(pickle.UnpicklingError):
    """The pickle referenced a global; raised before anything is imported or called."""


class _NoGlobals(pickle.Unpickler):
    """Unpickler for plain data: every global (class, function) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise _RefusedGlobal(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not allowed")


def _unpickle(f: Any, name: str) -> Any:
    """Unpickle from the file-like ``f`` with every global refused (a :class:`_Bounded` file is
    first walked for a count the unpickler would allocate by beyond the file: refused)."""
    if isinstance(f, _Bounded):
        f.check_counts(name)
    try:
        return _NoGlobals(f).load()
    except _RefusedGlobal as e:
        raise TraceError(f"{name}: not a PyTorch memory snapshot: the pickle needs the global {e} "
                         "(refused, nothing was executed)") from None
    except RecursionError:
        raise TraceError(f"{name}: pickle nests too deeply; not a memory snapshot") from None
    except MemoryError:
        raise TraceError(f"{name}: out of memory reading it: this machine has too little free memory for this "
                         "snapshot, or the file is corrupt or hostile") from None
    except Exception as e:  # truncated/corrupt pickles raise many different types
        raise TraceError(f"{name}: not a valid pickle; corrupt or truncated "
                         f"({type(e).__name__}: {str(e)[:120]})") from None


class _Bounded:
    """A file the unpickler may not read past its size: a length in the pickle larger than what
    is left is cut to it (and fails as truncated) instead of allocating what it claims."""

    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f, self.left = f, size

    def check_counts(self, name: str) -> None:
        """Refuse a pickle with a count the C unpickler allocates by unchecked (:func:`overreach`: a
        memo index far beyond the stores before it, a bytes object longer than the file). The file
        is at its start before and after."""
        over = overreach(self.f, self.left)
        self.f.seek(0)
        if over is not None:
            raise TraceError(f"{name}: not a valid pickle; corrupt or hostile ({over}; refused)")

    def read(self, n: int = -1) -> bytes:
        n = self.left if n is None or n < 0 else min(n, self.left)
        data = self.f.read(n)
        self.left -= len(data)
        return data

    def readline(self, limit: int = -1) -> bytes:
        limit = self.left if limit is None or limit < 0 else min(limit, self.left)
        data = self.f.readline(limit)
        self.left -= len(data)
        return data

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        n = self.f.readinto(view[:min(len(view), self.left)])
        self.left -= n
        return n

    def peek(self, n: int = 0) -> bytes:
        """What the unpickler may read ahead (it reads in large pieces this way, not opcode by opcode)."""
        return self.f.peek(n)[:self.left]


def check_head(path: Path, head: bytes) -> None:
    """Refuse a file whose first bytes say it is no snapshot pickle, naming what it is (other
    files are left to the unpickler, which stops at the first byte that is no pickle opcode)."""
    if head[:7] == MAGIC[:7]:
        what = "already an npu_pool trace (.npt): replay, analyze or plan it directly; there is nothing to import"
    elif head[:8] == PLAN_MAGIC:
        what = "an npu_pool plan (give it with --plan), not a memory snapshot"
    elif not head:
        what = "empty file: truncated, or not a memory snapshot"
    elif head[:1] == pickle.PROTO and (len(head) < 2 or head[1] > pickle.HIGHEST_PROTOCOL):
        what = ("truncated pickle" if len(head) < 2 else
                f"not a valid pickle; corrupt (protocol {head[1]}; this Python reads up to {pickle.HIGHEST_PROTOCOL})")
    else:
        return
    raise TraceError(f"{path}: {what}")


def load_snapshot(path: str | Path) -> list[Trace]:
    """Read a snapshot pickle; one Trace per device with recorded events. The first bytes are
    checked before anything else is read (a trace, a plan, any other file is refused at once,
    naming what it is); only regular files are read, and never past their size.

    The file is streamed (:mod:`.pickle_stream`): each ``device_traces`` entry is converted to
    its compact record as it is unpickled and then freed, so memory stays near the file's size
    instead of the 3-9x of the whole object tree. A file the streamed reader does not follow, or
    one it finds wrong in any way, is read again whole as before: that read gives the file's
    own answer and the same message as ever (the streamed result equals it where both succeed)."""
    path = Path(path)
    try:
        with open_regular(path) as f:
            st = os.fstat(f.fileno())
            check_head(path, f.read(8))
            out_of_memory = False
            bars = None if st.st_size >= _BAR_BYTES else False
            bar = ByteProgress(f"read {path.name}", 2 * st.st_size, enabled=bars)
            try:
                return _streamed(f, st.st_size, str(path), bar.to, bars=bars, on_read=bar.close)
            except MemoryError:  # the whole read needs 3-9x more: not tried
                out_of_memory = True  # (said below, once the failed read's frames are freed with the exception)
            except (NotStreamable, TraceError, RecursionError):
                pass  # read whole: the reference reading, with its own messages
            finally:
                bar.close()
            if out_of_memory:
                raise TraceError(f"{path}: out of memory reading it ({st.st_size} bytes): this machine has too little "
                                 "free memory for this snapshot (reading it takes about its size and more), or the "
                                 "file is corrupt or hostile")
            f.seek(0)
            obj = _unpickle(_Bounded(f, st.st_size), str(path))
    except NotRegularFile as e:
        raise TraceError(f"{path}: not a regular file ({e.kind}); give a snapshot file") from None
    except OSError as e:
        raise TraceError(f"{path}: cannot read ({e.strerror or e})") from None
    return snapshot_to_traces(obj, str(path), max_elements=st.st_size, _consume=True)


def _streamed(f: BinaryIO, size: int, name: str, progress: Callable[[int], None] = lambda _n: None, *,
              bars: bool | None = False, on_read: Callable[[], None] = lambda: None) -> list[Trace]:
    """:func:`load_snapshot` of a file streamed entry by entry; NotStreamable or TraceError when
    the file is to be read whole instead. ``progress``: as :func:`.pickle_stream.stream_dict`'s;
    ``on_read()`` once the file is read; ``bars``: whether the conversion shows bars (as
    :class:`.ByteProgress`'s ``enabled``)."""
    devices: list[tuple[_Events, _Sites] | None] = []  # None: no entry yet (made on the first one)
    probe = _Probe()
    frames_left = [_FRAMES_PER_BYTE * size]

    def on_list(dev: int) -> None:
        devices.append(None)

    def on_items(dev: int, items: list) -> None:
        if devices[dev] is None:
            devices[dev] = (_Events(), _Sites(name, frames_left))
        evs, sites = devices[dev]
        for e in items:
            if len(evs) < _PROBE_ENTRIES:
                probe.look(e)
            evs.add(_event(e, name, f"device_traces[{dev}][{len(evs)}]", sites))

    f.seek(0)
    rest = stream_dict(f, size, "device_traces", _NoGlobals, on_list, on_items, progress)
    progress(2 * size)
    on_read()
    none: list = []  # one empty list stands for every device without entries
    rest["device_traces"] = [d[0] if d else none for d in devices]
    segments, traces, annotations, settings = _validated(rest, name, size)
    seen: set[int] = set()
    segs = [_segment(s, name, f"segments[{i}]", seen) for i, s in enumerate(segments)]
    marks = _annotations(annotations, name)
    kind = probe.result(segments, rest.get("allocator_settings"))
    del rest, traces, segments, annotations

    def converted() -> Iterator[tuple[int, list[_Events], _Sites]]:
        for dev in range(len(devices)):
            if devices[dev] is None:
                continue
            box, sites = [devices[dev][0]], devices[dev][1]
            devices[dev] = None  # the builder takes the entries over
            if len(box[0]):
                yield dev, box, sites

    return _traces(name, converted(), segs, marks, settings, kind, bars=bars)


def snapshot_to_traces(obj: Any, name: str = "<snapshot>", max_elements: int | None = None, *,
                       _consume: bool = False) -> list[Trace]:
    """Convert an already-unpickled snapshot dict; ``name`` goes into messages and meta["origin"].
    ``max_elements``: refuse to walk more list elements than this (the file's size in bytes).
    (``_consume``: the dict is the caller's no more: each entry is replaced by its compact
    record as it is read, so the unpickled dicts are freed as the conversion goes.)"""
    segments, traces, annotations, settings = _validated(obj, name, max_elements)
    seen: set[int] = set()
    segs = [_segment(s, name, f"segments[{i}]", seen) for i, s in enumerate(segments)]
    marks = _annotations(annotations, name)
    kind = _device_type(obj)
    frames_left = [_FRAMES_PER_BYTE * max_elements] if max_elements is not None else None

    def converted() -> Iterator[tuple[int, list[_Events], _Sites]]:
        consumed: set[int] = set()  # ids of the event lists converted in place
        for dev, events in enumerate(traces):
            where = f"device_traces[{dev}]"
            if not events:
                continue
            sites = _Sites(name, frames_left)
            evs = _Events()
            if _consume:  # each dict is dropped as its record is taken
                if id(events) in consumed:
                    raise TraceError(f"{name}: {where} is the same list as another device's; not a memory snapshot")
                consumed.add(id(events))
                for i, e in enumerate(events):
                    evs.add(_event(e, name, f"{where}[{i}]", sites))
                    events[i] = None
                traces[dev] = []
            else:
                for i, e in enumerate(events):
                    evs.add(_event(e, name, f"{where}[{i}]", sites))
            del events
            box = [evs]
            del evs
            yield dev, box, sites

    return _traces(name, converted(), segs, marks, settings, kind)


def _validated(obj: Any, name: str, max_elements: int | None) -> tuple[list, list, list, Any]:
    """The checks of a snapshot's top level: (segments, device_traces, external_annotations,
    a bounded copy of allocator_settings or None)."""
    if not isinstance(obj, dict):
        raise TraceError(f"{name}: not a PyTorch memory snapshot (top level is {type(obj).__name__}, not dict)")
    segments = obj.get("segments", [])
    _expect(isinstance(segments, list), name, "segments", "a list", segments)
    traces = obj.get("device_traces")
    _expect(traces is None or isinstance(traces, list), name, "device_traces", "a list", traces)
    if traces is not None:
        for i, t in enumerate(traces):
            _expect(isinstance(t, (list, _Events)), name, f"device_traces[{i}]", "a list", t)
    if traces is None or all(len(t) == 0 for t in traces):
        if traces is None and "segments" not in obj:
            raise TraceError(f"{name}: not a PyTorch memory snapshot (no 'device_traces' key)")
        what = "has segments but no device_traces events" if segments else "has no device_traces events"
        raise TraceError(f"{name}: snapshot {what}; it was recorded without "
                         "torch.cuda.memory._record_memory_history() (or before any allocation)")
    annotations = obj.get("external_annotations") or []
    _expect(isinstance(annotations, list), name, "external_annotations", "a list", annotations)
    if max_elements is not None:
        walked = len(segments) + len(annotations) + sum(len(t) for t in traces)
        walked += sum(len(s.get("blocks", ())) for s in segments if isinstance(s, dict) and isinstance(s.get("blocks"), list))
        if walked > max_elements:
            raise TraceError(f"{name}: the snapshot references {walked} events, segments and blocks in {max_elements} "
                             "bytes: shared references repeated beyond what a real snapshot holds; refused")
    settings = obj.get("allocator_settings")
    if settings is not None:
        _expect(isinstance(settings, dict), name, "allocator_settings", "a dict", settings)
        settings = _bounded(settings)
    return segments, traces, annotations, settings


def _traces(name: str, devices: Iterable[tuple[int, list["_Events"], "_Sites"]], segs: list[dict],
            marks: dict[int, list[tuple[int, int, int]]], settings: Any, kind: str | None, *,
            bars: bool | None = False) -> list[Trace]:
    """One Trace per device from its converted events, each handed over in a list of one that
    is emptied here (the builder frees them before it assembles the trace's columns). ``bars``:
    a bar over each device's events as they are translated (as :class:`.ByteProgress`'s
    ``enabled``; after the read, a 1.8 GB snapshot's took 14 s)."""
    out = []
    for dev, box, sites in devices:
        dev_segs = [s for s in segs if s["device"] == dev]
        bar = ByteProgress(f"convert {Path(name).name} (device {dev})", len(box[0]), enabled=bars, unit="event")
        builder = _Builder(name, dev, box.pop(), dev_segs, check_segments=bool(segs), marks=marks.get(dev, []),
                           sites=sites, progress=bar.to)
        try:
            t = builder.build()
        finally:
            bar.close()
        del builder
        t.meta["origin"] = name
        t.meta["device"] = dev
        expandable = any(s["is_expandable"] for s in segs)
        if settings is not None:
            t.meta["allocator_settings"] = settings
            expandable = expandable or settings.get("expandable_segments") is True
        t.meta["expandable_segments"] = expandable
        if kind:
            t.meta["device_type"] = kind
        out.append(t)
    return out


# Which runtime recorded a snapshot: the one npu_pool's own snapshots name
# (allocator_settings["device_type"]), else the allocator named in its C++ frames (torch_npu's
# NPUCachingAllocator in c10_npu, or CUDA's in c10::cuda) or a Python frame in torch_npu's code;
# without those, from the "allocator_settings" CUDA's snapshots carry and torch_npu's do not
# (torch_npu/csrc/npu/Module.cpp writes segments and device_traces only). Looks at no more than
# _DEVICE_PROBE frames.
_DEVICE_PROBE = 4096
_DEVICE_MARKS = (("npu", ("NPUCachingAllocator", "c10_npu::", "torch_npu")),
                 ("cuda", ("CUDACachingAllocator", "c10::cuda::")))


_PROBE_ENTRIES = 64  # entries looked at per device, and segments


class _Probe:
    """The device type, from entries seen in order: each device's first _PROBE_ENTRIES trace
    entries, then the first _PROBE_ENTRIES segments; the first frame that names a runtime wins."""

    def __init__(self) -> None:
        self.budget, self.kind = _DEVICE_PROBE, None

    def look(self, entry: Any) -> None:
        if self.kind is not None or self.budget <= 0:
            return
        frames = entry.get("frames") if isinstance(entry, dict) else None
        for f in frames[:self.budget] if isinstance(frames, list) else ():
            if not isinstance(f, dict):
                continue
            text = " ".join(v for v in (f.get("name"), f.get("filename")) if isinstance(v, str))
            for kind, marks in _DEVICE_MARKS:
                if any(m in text for m in marks):
                    self.kind = kind
                    return
        self.budget -= len(frames) if isinstance(frames, list) else 0

    def result(self, segments: Any, settings: Any) -> str | None:
        """"npu", "cuda", or None when the snapshot does not say (npu_pool's own snapshots say it
        in allocator_settings["device_type"])."""
        said = settings.get("device_type") if isinstance(settings, dict) else None
        if said in ("npu", "cuda"):
            return said
        for s in [s for s in segments or [] if isinstance(s, dict)][:_PROBE_ENTRIES]:
            self.look(s)
        return self.kind or ("cuda" if isinstance(settings, dict) else None)


def _device_type(obj: dict) -> str | None:
    """"npu", "cuda", or None when the snapshot does not say."""
    probe = _Probe()
    for t in obj.get("device_traces") or []:
        for e in t[:_PROBE_ENTRIES] if isinstance(t, list) else ():
            probe.look(e)
    return probe.result(obj.get("segments"), obj.get("allocator_settings"))


_REPR = reprlib.Repr()  # a few items and levels of a container, never all of it
_REPR.maxstring = _REPR.maxother = 200


def _shown(v: Any, width: int) -> str:
    """``repr(v)`` in at most ``width`` characters, made without formatting what is cut off: an
    untrusted value may be a list of a million references to one long string, a tuple nested a
    million deep, or an integer of more digits than Python turns into text (ValueError)."""
    if type(v) is str:
        return repr(v[:width])[:width]
    try:
        return (repr(v) if v is None or type(v) in (bool, int, float) else _REPR.repr(v))[:width]
    except (ValueError, RecursionError):
        return f"<{type(v).__name__}>"


def _bounded(obj: Any) -> Any:
    """A JSON-safe copy of untrusted settings: at most _SETTINGS_DEPTH levels and _SETTINGS_VALUES
    values; deeper or further parts become "...". Shared references are copied at most that often."""
    budget = [_SETTINGS_VALUES]

    def copy(x: Any, depth: int) -> Any:
        budget[0] -= 1
        if budget[0] < 0 or depth > _SETTINGS_DEPTH:
            return "..."
        if isinstance(x, bool) or x is None or isinstance(x, (int, float)):
            return x if not isinstance(x, int) or -(1 << 63) <= x < 1 << 64 else _shown(x, 40)
        if isinstance(x, str):
            return x[:200]
        if isinstance(x, dict):
            return {k[:100] if type(k) is str else _shown(k, 100): copy(v, depth + 1)
                    for k, v in islice(x.items(), max(budget[0], 0))}  # (never a list of all: x may be shared)
        if isinstance(x, (list, tuple)):
            return [copy(v, depth + 1) for v in islice(x, max(budget[0], 0))]
        return _shown(x, 200)

    return copy(obj, 0)


_STEP = re.compile(r"^(?:ProfilerStep|iteration|iter|step)[#\s_]*(\d+)$", re.I)
_LAYER = re.compile(r"^(?:layer|layers)[#\s_.]*(\d+)$", re.I)
_PHASE_WORDS = {"setup": MARK_SETUP_BEGIN, "forward": MARK_FORWARD_BEGIN, "backward": MARK_BACKWARD_BEGIN,
                "optimizer": MARK_OPTIMIZER_BEGIN, "eval": MARK_EVAL_BEGIN, "evaluation": MARK_EVAL_BEGIN,
                "validation": MARK_EVAL_BEGIN, "iteration": MARK_ITER_BEGIN, "step": MARK_ITER_BEGIN}


def marker_of(name: str) -> tuple[int, int, bool] | None:
    """(marker code, argument, exact) for an annotation's name, or None when it names no phase.

    A range gives its phase's begin code (its END annotation the end code, begin + 1):
    ``ProfilerStep#3`` / ``iteration 3`` / ``step 3``: iteration 3; ``Optimizer.step#...``: the
    optimizer; ``layer 5`` / ``layers.5``: layer 5; ``forward``, ``backward``, ``setup``,
    ``eval``/``evaluation``/``validation``, ``optimizer``, ``iteration``, ``step`` (alone, or
    with a number as npu_pool's exports name them). npu_pool's own markers,
    ``npu_pool::<marker>::<arg>``, are ``exact``: that very code, taken at START only. Case does
    not matter."""
    n = name.strip()
    if n.startswith(PROFILER_PREFIX):
        own = profiled_mark(n)
        return (*own, True) if own is not None else None
    if n.startswith("Optimizer.step"):
        return MARK_OPTIMIZER_BEGIN, -1, False
    for pattern, code in ((_STEP, MARK_ITER_BEGIN), (_LAYER, MARK_LAYER_ENTER)):
        m = pattern.match(n)
        if m:
            arg = _number(m.group(1))
            return (code, arg, False) if arg is not None else None
    word, _, rest = n.lower().partition(" ")
    if word in _PHASE_WORDS and (not rest or rest.lstrip("-").isdigit()):
        arg = _number(rest) if rest else -1
        return (_PHASE_WORDS[word], arg, False) if arg is not None else None
    return None


def _number(text: str) -> int | None:
    """The number a name ends with, None when it is none a marker holds (beyond 64 bits, or
    digits ``int`` does not take, such as "²"): such a name names no phase."""
    try:
        v = int(text) if len(text) <= 20 else None
    except ValueError:
        return None
    return v if v is not None and -(1 << 63) <= v < 1 << 63 else None


def _annotations(annotations: list, name: str) -> dict[int, list[tuple[int, int, int]]]:
    """Per device, the annotations that name a phase as (time_us, marker code, arg), in time order."""
    out: dict[int, list[tuple[int, int, int]]] = {}
    for i, a in enumerate(annotations):
        where = f"external_annotations[{i}]"
        _expect(isinstance(a, dict), name, where, "a dict", a)
        label, stage = a.get("name"), a.get("stage")
        if not isinstance(label, str) or stage not in ("START", "END"):
            continue
        mark = marker_of(label)
        if mark is None or (mark[2] and stage == "END"):
            continue
        code, arg, exact = mark
        t = _int(a, "time_us", name, where, signed=True)
        out.setdefault(_int(a, "device", name, where, 0), []).append((t, code + (stage == "END" and not exact), arg))
    for marks in out.values():
        marks.sort(key=lambda m: m[0])
    return out


# -- validation of the untrusted dicts -----------------------------------------------------


def _expect(ok: bool, name: str, where: str, what: str, value: Any) -> None:
    if not ok:
        raise TraceError(f"{name}: {where} should be {what}, got {type(value).__name__}")


def _int(d: dict, key: str, name: str, where: str, default: int | None = None, signed: bool = False) -> int:
    v = d.get(key, default)
    if type(v) is int and ((-(1 << 63) <= v < 1 << 63) if signed else (0 <= v < 1 << 64)):
        return v  # the common case, checked first
    if v is None:
        raise TraceError(f"{name}: {where} has no {key!r}")
    lo, hi = (-(1 << 63), 1 << 63) if signed else (0, 1 << 64)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v < hi:  # (True is no size of 1 byte)
        raise TraceError(f"{name}: {where}.{key} should be a{'n' if signed else ' non-negative'} "
                         f"64-bit integer, got {_shown(v, 60)}")
    return v


_STREAM_MIN = max(STREAM_TAGS) + 1  # (the fast path's bound: the tags are the two lowest values)


def _stream(d: dict, name: str, where: str) -> int:
    """A stream of the file; the core's tags of free memory (vocab.STREAM_TAGS: no device stream
    has them; npu_pool's snapshots before 2026-11-27 wrote them for memory kept for no one
    stream, or a resume that failed) read as the default stream, which the core takes."""
    return device_stream(_int(d, "stream", name, where, 0, signed=True))


def _frames(d: dict, name: str, where: str) -> list:
    frames = d.get("frames", [])
    _expect(isinstance(frames, list), name, f"{where}.frames", "a list", frames)
    return frames


def _event(e: Any, name: str, where: str, sites: "_Sites") -> tuple:
    """Check one trace entry; return (action, addr, size, stream, site, time_us or -1, device_free):
    the site (of an alloc or a failed request) interned in ``sites``, the frames not kept."""
    if type(e) is dict:  # the common case at once; anything else through every check, in order
        action, frames = e.get("action"), e.get("frames", [])
        if type(action) is str and action != "oom" and type(frames) is list:
            addr, size, stream, t = e.get("addr"), e.get("size"), e.get("stream", 0), e.get("time_us", -1)
            if (type(addr) is int and type(size) is int and type(stream) is int and type(t) is int
                    and 0 <= addr < 1 << 64 and 0 <= size <= MAX_REQUEST and _STREAM_MIN <= stream < 1 << 63
                    and -(1 << 63) <= t < 1 << 63):
                return (sys.intern(action) if len(action) < 40 else action, addr, size, stream,
                        sites.site(frames, where) if action == "alloc" else -1, t, 0)
    return _event_checked(e, name, where, sites)


def _event_checked(e: Any, name: str, where: str, sites: "_Sites") -> tuple:
    """:func:`_event`, each field checked in turn with its message."""
    _expect(isinstance(e, dict), name, where, "a dict", e)
    action = e.get("action")
    _expect(isinstance(action, str), name, f"{where}.action", "a string", action)
    oom = action == "oom"  # a failed request: no address, the device's free bytes instead
    frames = _frames(e, name, where)
    site = sites.site(frames, where) if action == "alloc" or oom else -1
    free = _bytes(e, "device_free", name, where, 0) if oom else 0
    return (sys.intern(action) if len(action) < 40 else action, _int(e, "addr", name, where, 0 if oom else None),
            _bytes(e, "size", name, where), _stream(e, name, where), site,
            _int(e, "time_us", name, where, -1, signed=True), free)


def _bytes(d: dict, key: str, name: str, where: str, default: int | None = None) -> int:
    """A size in bytes (:func:`_int`), at most 2^48 (MAX_REQUEST): no device has more, and sums
    of such sizes stay far inside 64 bits."""
    v = _int(d, key, name, where, default)
    if v > MAX_REQUEST:
        raise TraceError(f"{name}: {where}.{key} is {v} bytes, more than any device has (2^48)")
    return v


def _once(obj: Any, seen: set[int], name: str, where: str, what: str) -> None:
    """Refuse ``obj`` listed before (its id in ``seen``): one object referenced again, a memo
    reference of two bytes in the file, would cost a record each."""
    if id(obj) in seen:
        raise TraceError(f"{name}: {where} is a {what} listed before (one object referenced again): "
                         "not a memory snapshot")
    seen.add(id(obj))


def _segment(s: Any, name: str, where: str, seen: set[int]) -> dict:
    """Check one end-state segment; return the fields the importer uses. ``seen``: the ids of the
    segment and block objects read so far (each is one object, listed once: :func:`_once`)."""
    _expect(isinstance(s, dict), name, where, "a dict", s)
    _once(s, seen, name, where, "segment")
    blocks = s.get("blocks", [])
    _expect(isinstance(blocks, list), name, f"{where}.blocks", "a list", blocks)
    out_blocks = []
    for j, b in enumerate(blocks):
        bw = f"{where}.blocks[{j}]"
        _expect(isinstance(b, dict), name, bw, "a dict", b)
        _once(b, seen, name, bw, "block")
        state = b.get("state")
        _expect(isinstance(state, str), name, f"{bw}.state", "a string", state)
        size = _bytes(b, "size", name, bw)
        out_blocks.append({"addr": _int(b, "address", name, bw), "size": size, "state": state,
                           "requested": _bytes(b, "requested_size", name, bw, size),
                           "frames": _frames(b, name, bw)})
    kind = s.get("segment_type")
    return {"device": _int(s, "device", name, where, 0), "addr": _int(s, "address", name, where),
            "size": _bytes(s, "total_size", name, where), "stream": _stream(s, name, where),
            "pool": {"small": POOL_SMALL, "large": POOL_LARGE}.get(kind) if isinstance(kind, str) else None,
            "is_expandable": bool(s.get("is_expandable", False)), "blocks": out_blocks}


def _pool(size: int) -> int:
    return POOL_SMALL if size == _SMALL_SEGMENT else POOL_LARGE


# -- sites ---------------------------------------------------------------------------------


class _Events:
    """One device's checked trace entries (:func:`_event`'s records) in columns: 40 bytes an
    entry, where a tuple of Python ints takes about 200. Iterating or indexing gives the records."""

    def __init__(self) -> None:
        self.names: list[str] = []  # action code -> action
        self._codes: dict[str, int] = {}
        self.action, self.addr, self.size = array("I"), array("Q"), array("Q")
        self.stream, self.site, self.time = array("q"), array("i"), array("q")
        self.device_free: dict[int, int] = {}  # entry -> free bytes, of the failed requests that say it

    def add(self, record: tuple) -> None:
        action, addr, size, stream, site, time_us, device_free = record
        code = self._codes.get(action)
        if code is None:
            code = self._codes[action] = len(self.names)
            self.names.append(action)
        if device_free:
            self.device_free[len(self.action)] = device_free
        self.action.append(code)
        self.addr.append(addr)
        self.size.append(size)
        self.stream.append(stream)
        self.site.append(site)
        self.time.append(time_us)

    def __len__(self) -> int:
        return len(self.action)

    def __iter__(self) -> Iterator[tuple]:
        return zip(map(self.names.__getitem__, self.action), self.addr, self.size, self.stream, self.site,
                   self.time, map(self.device_free.get, range(len(self.action)), repeat(0)))

    def __getitem__(self, i: int) -> tuple:
        return (self.names[self.action[i]], self.addr[i], self.size[i], self.stream[i], self.site[i], self.time[i],
                self.device_free.get(i, 0))

    def backwards(self) -> Iterator[tuple[int, str, int, int, int]]:
        """(index, action, addr, size, stream) from the last entry to the first."""
        return zip(range(len(self.action) - 1, -1, -1), map(self.names.__getitem__, reversed(self.action)),
                   reversed(self.addr), reversed(self.size), reversed(self.stream))


class _Rows:
    """The window's rows [op, cat, site, id, size, stream, addr] in columns (a Trace's types)."""

    def __init__(self) -> None:
        self.cols = (array("B"), array("B"), array("i"), array("q"), array("Q"), array("q"), array("Q"))

    def append(self, row: Iterable[int]) -> None:
        for col, v in zip(self.cols, row):
            col.append(v)

    def adder(self) -> Callable[[int, int, int, int, int, int, int], None]:
        """append(row) for the hot loop: the seven values as arguments."""
        op, cat, site, id_, size, stream, addr = (col.append for col in self.cols)

        def add(o: int, c: int, s: int, i: int, z: int, t: int, a: int) -> None:
            op(o), cat(c), site(s), id_(i), size(z), stream(t), addr(a)
        return add

    def __len__(self) -> int:
        return len(self.cols[0])

    def __getitem__(self, j: int) -> list[int]:
        return [col[j] for col in self.cols]


class _Sites:
    """Interns call-site strings built from an event's Python frames."""

    def __init__(self, name: str, frames_left: list[int] | None = None) -> None:
        self.name = name
        # frames the sites may still look at, shared by all devices (None: unbounded): a frame list
        # shared by every entry costs the file a byte or two an entry, and would be walked each time
        self.frames_left = frames_left
        self.strings: list[str] = []
        self._index: dict[str, int] = {}
        # frame objects (by identity) -> site: PyTorch shares each distinct frame dict between the
        # tracebacks that hold it, so a few hundred frame sequences stand for thousands of events.
        # The entry keeps its frames alive, so their ids cannot be reused; bounded in frames held.
        self._seen: dict[tuple[int, ...], tuple[int, tuple]] = {}
        self._held: set[int] = set()  # ids of the frames the entries keep alive

    def site(self, frames: list, where: str) -> int:
        """Index of the site for ``frames`` (innermost first), -1 when there is no Python frame."""
        if self.frames_left is not None:
            self.frames_left[0] -= len(frames)
            if self.frames_left[0] < 0:
                raise TraceError(f"{self.name}: the entries and blocks hold more than {_FRAMES_PER_BYTE} frames a byte "
                                 "of the file: shared references repeated beyond what a real snapshot holds; refused")
        key = tuple(map(id, frames))
        hit = self._seen.get(key)
        if hit is not None:
            return hit[0]
        idx = self._site(frames, where)
        if len(self._held) < _SITES_HELD and len(self._seen) < _SITES_HELD // 4:
            self._seen[key] = (idx, tuple(frames))
            self._held.update(key)
        return idx

    def _site(self, frames: list, where: str) -> int:
        user, lib = [], []
        for f in frames:
            if not isinstance(f, dict):
                raise TraceError(f"{self.name}: {where}.frames should hold dicts, got {type(f).__name__}")
            fn = f.get("filename", "")
            if not isinstance(fn, str) or not (fn.endswith(".py") or fn == SITE_FILE) or len(fn) > _PATH_MAX:
                continue
            (lib if _LIB_FRAME.search(fn) else user).append(f)
            if len(user) == _SITE_FRAMES:
                break
        chosen = user or lib[:_SITE_FRAMES]
        if not chosen:
            return -1
        key = " < ".join(_label(f.get("name", "?"))[:_LABEL] if f["filename"] == SITE_FILE else  # (an export's op path)
                         f"{_short(f['filename'])[-_LABEL:]}:{_label(f.get('line', 0))[:_LABEL]}:"
                         f"{_label(f.get('name', '?'))[:_LABEL]}" for f in chosen)  # (each part bounded: a site per entry)
        idx = self._index.get(key)
        if idx is None:
            idx = self._index[key] = len(self.strings)
            self.strings.append(key)
        return idx


def _label(v: Any) -> str:
    """A frame's line or name in a site: as ``str`` gives it for a string or a 64-bit integer,
    else bounded (:func:`_shown`)."""
    return v if type(v) is str else str(v) if type(v) is int and -(1 << 63) <= v < 1 << 64 else _shown(v, 60)


def _short(filename: str) -> str:
    """The last two components of a path: enough to tell files apart, no home directories."""
    parts = re.split(r"[\\/]", filename)
    return "/".join(parts[-2:])


# -- the conversion ------------------------------------------------------------------------


class _Builder:
    """Builds one device's Trace: window events, then the rebuilt initial state in front."""

    def __init__(self, name: str, dev: int, events: list[tuple], segments: list[dict], check_segments: bool,
                 marks: list[tuple[int, int, int]] = (), sites: "_Sites | None" = None,
                 progress: Callable[[int], None] = lambda _n: None):
        self.name, self.dev, self.events, self.segments = name, dev, events, segments
        self.progress = progress  # (events translated so far)
        self.check_segments = check_segments
        self.marks = list(marks)  # (time_us, code, arg) in time order
        self.ooms: list[dict[str, int]] = []
        self.sites = sites if sites is not None else _Sites(name)
        self.warnings: list[str] = []
        self.n_warnings = 0
        self.ignored: dict[str, int] = {}
        # window events as rows [op, cat, site, id, size, stream, addr]; ids < 0 name initial allocs
        self.rows = _Rows()
        self.init_allocs: list[list[int]] = []  # rows with op OP_INIT_ALLOC, provisional ids -1, -2, ...
        self.n_window_ids = 0

    def warn(self, msg: str) -> None:
        self.n_warnings += 1
        if len(self.warnings) < _MAX_WARNINGS:
            self.warnings.append(msg)

    def build(self) -> Trace:
        live = self._window()
        self._end_state(live)
        init_segs = self._initial_segments()
        self._check_inside(init_segs)
        recorded = self._recorded(init_segs)
        self.events = None  # freed (when the caller let go of them too) before the columns are assembled
        return self._assemble(init_segs, recorded)

    def _free_points(self) -> set[int]:
        """Indices of free_requested events that are a block's free point (no free_completed follows)."""
        pending: dict[int, int] = {}
        use: set[int] = set()
        for i, (action, addr, *_) in enumerate(self.events):
            if action == "free_requested":
                if addr in pending:
                    use.add(pending[addr])
                pending[addr] = i
            elif action == "free_completed":
                pending.pop(addr, None)
            elif action == "alloc" and addr in pending:
                use.add(pending.pop(addr))
        use.update(pending.values())
        return use

    def _window(self) -> dict[int, int]:
        """Translate the window's events; return the allocations live at its end (addr -> row)."""
        use_requested = self._free_points()
        live: dict[int, int] = {}  # address -> row of its allocation
        self.seen: set[int] = set()  # addresses allocated or freed in the window
        rows, prev = self.rows, None
        add = rows.adder()
        marks, m = self.marks, 0
        if marks and any(ev[5] < 0 for ev in self.events):
            self.warn("events carry no time_us: the annotations cannot be placed among them; left out")
            marks = []
        for i, (action, addr, size, stream, site, time_us, device_free) in enumerate(self.events):
            if not i & 0xFFFF:
                self.progress(i)
            while m < len(marks) and marks[m][0] < time_us:  # phases that began or ended before this event
                rows.append([OP_MARK, marks[m][1], -1, marks[m][2], 0, 0, 0])
                m += 1
            if action == "alloc":
                if addr in live:
                    self.warn(f"event {i}: alloc at {addr:#x} which is still live; freeing the old block first")
                    self._free(rows[live.pop(addr)])
                live[addr] = len(rows)
                add(OP_ALLOC, CAT_UNKNOWN, site, self.n_window_ids, size, stream, addr)
                self.n_window_ids += 1
                self.seen.add(addr)
            elif action == "free_completed" or (action == "free_requested" and i in use_requested):
                j = live.pop(addr, None)
                if j is None and addr in self.seen:
                    self.warn(f"event {i}: {action} at {addr:#x} which was already freed; ignored")
                else:
                    if j is None:  # allocated before the window began
                        row = [OP_INIT_ALLOC, CAT_UNKNOWN, -1, -1 - len(self.init_allocs), size, stream, addr]
                        self.init_allocs.append(row)
                    else:
                        row = rows[j]
                        if row[4] != size:
                            self.warn(f"event {i}: {action} size {size} differs from the alloc's {row[4]}")
                    self.seen.add(addr)
                    self._free(row)
            elif action in _SEG_NEW:
                rows.append([OP_SEG_HINT, _pool(size), -1, -1, size, stream, addr])
            elif action in _SEG_GONE:
                if prev not in _SEG_GONE:
                    rows.append([OP_EMPTY_CACHE, 0, -1, -1, 0, stream, 0])
                rows.append([OP_SEG_FREE, _pool(size), -1, -1, size, stream, addr])
            elif action == "oom":
                if size:
                    self.ooms.append({"event": len(rows), "size": size, "device_free": device_free})
                    rows.append([OP_OOM, CAT_UNKNOWN, site, -1, size, stream, 0])
            else:
                if action not in _IGNORED:
                    self.warn(f"event {i}: unknown action {action!r:.40}; ignored")
                self.ignored[action] = self.ignored.get(action, 0) + 1
            prev = action
        for time_us, code, arg in marks[m:]:
            rows.append([OP_MARK, code, -1, arg, 0, 0, 0])
        self.progress(len(self.events))
        return live

    def _free(self, alloc_row: list[int]) -> None:
        self.rows.append([OP_FREE, *alloc_row[1:]])

    def _end_state(self, live: dict[int, int]) -> None:
        """Add end-state allocated blocks with no event in the window as initial allocations."""
        active = set()
        for seg in self.segments:
            for b in seg["blocks"]:
                if b["state"] not in _ACTIVE:
                    continue
                active.add(b["addr"])
                j = live.get(b["addr"])
                if j is not None:
                    size = self.rows.cols[4][j]
                    if size != b["requested"]:
                        self.warn(f"block {b['addr']:#x}: end-state requested size {b['requested']} "
                                  f"differs from its alloc's {size}")
                elif b["addr"] not in self.seen:
                    site = self.sites.site(b["frames"], f"block {b['addr']:#x}")
                    self.init_allocs.append([OP_INIT_ALLOC, CAT_UNKNOWN, site, -1 - len(self.init_allocs),
                                             b["requested"], seg["stream"], b["addr"]])
                elif b["state"] == "active_allocated":
                    self.warn(f"block {b['addr']:#x} is allocated at the end but was freed in the window")
        if self.check_segments:
            missing = [a for a in live if a not in active]
            if missing:
                self.warn(f"{len(missing)} allocations live at the window's end are not active blocks of the "
                          f"end-state segments (first at {missing[0]:#x})")

    def _initial_segments(self) -> dict[int, tuple[int, int, int]]:
        """Segments reserved when the window began: end state, undone backwards (addr -> size, stream, pool).
        A segment_alloc/free makes or frees the segment at its address; a segment_map/unmap (expandable
        segments) maps or unmaps a range, so undoing it removes or adds that range. Segments that
        overlap one already there (no device hands out such) are left out with a warning."""
        starts = {s["addr"] for s in self.segments}  # every start a segment can have: these, and the
        for _, action, addr, size, _ in self.events.backwards():  # ends of the ranges events cut
            if action in _SEG_NEW or action in _SEG_GONE:
                starts.update((addr, addr + size))
        segs = SegmentMap(starts)
        for s in self.segments:
            self._put_segment(segs, s["addr"], (s["size"], s["stream"],
                                                s["pool"] if s["pool"] is not None else _pool(s["size"])), "end state")
        for i, action, addr, size, stream in self.events.backwards():
            if action == "segment_unmap":
                segs.add_range(addr, size, stream)
            elif action == "segment_map":
                if not segs.remove_range(addr, size):
                    self.warn(f"event {i}: segment_map of {addr:#x} (+{size} bytes) mapped a range that is neither in "
                              "the end state nor unmapped later in the window")
            elif action in _SEG_GONE:
                if segs.pop(addr) is not None:
                    self.warn(f"event {i}: {action} at {addr:#x}, but a segment is there again later "
                              "without a segment_alloc")
                self._put_segment(segs, addr, (size, stream, _pool(size)), f"event {i}: {action}")
            elif action in _SEG_NEW:
                if segs.pop(addr) is None:
                    self.warn(f"event {i}: {action} at {addr:#x} made a segment that is neither in the end "
                              "state nor freed later in the window")
        return segs.segs

    def _put_segment(self, segs: "SegmentMap", addr: int, value: tuple[int, int, int], where: str) -> None:
        other = segs.put(addr, value)
        if other is not None:
            self.warn(f"{where}: the segment at {addr:#x} (+{value[0]} bytes) "
                      f"{'holds no bytes' if not value[0] else f'overlaps the one at {other:#x}'}: left out")

    def _check_inside(self, segs: dict[int, tuple[int, int, int]]) -> None:
        if not self.check_segments or not self.init_allocs:
            return
        starts = sorted(segs)
        outside = 0
        for row in self.init_allocs:
            addr, size = row[6], row[4]
            k = bisect.bisect_right(starts, addr) - 1
            if k < 0 or addr + size > starts[k] + segs[starts[k]][0]:
                outside += 1
                if outside == 1:
                    self.warn(f"initial allocation at {addr:#x} ({size} bytes) lies in no initial segment")
        if outside > 1:
            self.warn(f"{outside} initial allocations lie in no initial segment")

    def _assemble(self, init_segs: dict[int, tuple[int, int, int]], recorded: dict[str, int]) -> Trace:
        # Initial allocs get ids 0..k-1 in address order, window allocs k.. in event order.
        self.init_allocs.sort(key=lambda r: r[6])
        k = len(self.init_allocs)
        remap = {row[3]: j for j, row in enumerate(self.init_allocs)}
        t = Trace()
        cols = (t.op, t.cat, t.site, t.id, t.size, t.stream, t.addr)
        for addr in sorted(init_segs):
            size, stream, pool = init_segs[addr]
            _put(cols, (OP_INIT_SEGMENT, pool, -1, -1, size, stream, addr))
        for row in self.init_allocs:
            row[3] = remap[row[3]]
            _put(cols, row)
        # the window's columns become the trace's, behind what comes first: no second copy of them
        window = list(self.rows.cols)
        self.rows = _Rows()
        window[3] = array("q", (i if o != OP_ALLOC and o != OP_FREE else remap[i] if i < 0 else i + k
                                for o, i in zip(window[0], window[3])))
        for j, name in enumerate(("op", "cat", "site", "id", "size", "stream", "addr")):
            window[j][0:0] = cols[j]
            setattr(t, name, window[j])
            window[j] = None
        if self.n_warnings > len(self.warnings):
            self.warnings.append(f"... and {self.n_warnings - len(self.warnings)} more warnings")
        base = len(init_segs) + k  # window rows follow the initial segments and allocations
        t.meta.update(sites=self.sites.strings, n_ids=k + self.n_window_ids, ignored_events=self.ignored,
                      warnings=self.warnings, recorded=recorded,
                      ooms=[dict(o, event=o["event"] + base) for o in self.ooms])
        return t

    def _recorded(self, init_segs: dict[int, tuple[int, int, int]]) -> dict[str, int]:
        """What the stock allocator reserved: at the window's start and at its peak."""
        sizes = {a: v[0] for a, v in init_segs.items()}
        reserved = initial = sum(sizes.values())
        peak, n_new = reserved, 0
        for action, addr, size, *_ in self.events:
            if action in _SEG_NEW:
                n_new += action == "segment_alloc"
                reserved += size
                sizes[addr] = size
                peak = max(peak, reserved)
            elif action in _SEG_GONE:
                reserved -= size if size else sizes.get(addr, 0)
        return {"peak_reserved_bytes": peak, "segment_allocs": n_new, "initial_reserved_bytes": initial}


def _put(cols: Iterable, row: Iterable[int]) -> None:
    for col, v in zip(cols, row):
        col.append(v)
