"""The npu_pool trace: one device's allocation events in columns, plus metadata.

A trace is what every tool of the project reads: replay, planner, reports. It is
columnar (one ``array.array`` per field) so the C replay loop reads the columns in
place and a million-event file loads in milliseconds.

Event ops (column ``op``):

====================  ============================================================
``OP_ALLOC``          ``id`` (dense, 0..n_ids-1), ``size`` (requested bytes),
                      ``stream``, ``site`` (index into ``meta["sites"]`` or -1),
                      ``cat`` (a ``CAT_*`` tensor category), ``addr`` (recorded
                      address or 0)
``OP_FREE``           ``id`` of a live allocation and its ``size``; other fields copy the alloc's
``OP_MARK``           a phase marker: ``cat`` is a ``MARK_*`` code, ``id`` its
                      argument (layer index, micro-batch index, iteration), -1 none
``OP_EMPTY_CACHE``    the recorded program released the allocator's cache here
``OP_SEG_HINT``       the recorded allocator mapped a segment at ``addr`` of
                      ``size`` on ``stream`` (``cat``: ``POOL_SMALL``/``POOL_LARGE``);
                      used only to reproduce recorded addresses (``--validate``)
``OP_SEG_FREE``       the recorded allocator released the segment at ``addr``
``OP_INIT_SEGMENT``   before the window: a segment at ``addr``/``size``/``stream``
                      was already reserved (``cat``: pool) -- fidelity replays prime it
``OP_INIT_ALLOC``     before the window: allocation ``id`` was already live at
                      ``addr``; replays allocate these first, in address order
``OP_OOM``            the recorded program asked for ``size`` bytes on ``stream``
                      and the allocator could not serve them (``addr`` 0); replays
                      try the request and free it at once if it is served
``OP_REGION``         allocations that follow belong to tag ``id`` (0..31), until the
                      next ``OP_REGION``; ``id`` -1 leaves the region
``OP_PAUSE``          the program paused tag ``id`` (``cat`` 1: with a backup of its
                      contents); its live allocations stay live, none is made inside
                      a paused tag's region
``OP_RESUME``         the program resumed tag ``id`` (paused before)
====================  ============================================================

All ``OP_INIT_*`` events come first, segments then allocations, both in address order.

``meta["device_type"]`` (``"npu"`` or ``"cuda"``, absent when unknown) says which runtime
recorded the trace: replays apply that runtime's request rules (:func:`device_type`).
"""
from __future__ import annotations

import array
import json
import os
import struct
import sys
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterator, NamedTuple

from .._core import ffi, lib

# Ops, categories and markers are the core's vocabulary (npu_pool.h), defined once there.
from ..vocab import (CAT_ACTIVATION, CAT_AUTOGRAD_DETAIL, CAT_GRADIENT, CAT_INPUT, CAT_NAMES,  # noqa: F401
                     CAT_OPTIMIZER_STATE, CAT_PARAMETER, CAT_TEMPORARY, CAT_UNKNOWN, MARK_BACKWARD_BEGIN,
                     MARK_BACKWARD_END, MARK_EVAL_BEGIN, MARK_EVAL_END, MARK_FORWARD_BEGIN, MARK_FORWARD_END,
                     MARK_ITER_BEGIN, MARK_ITER_END, MARK_LAYER_ENTER, MARK_LAYER_EXIT, MARK_NAMES,
                     MARK_OPTIMIZER_BEGIN, MARK_OPTIMIZER_END, MARK_SETUP_BEGIN, MARK_SETUP_END, OP_ALLOC,
                     OP_EMPTY_CACHE, OP_FREE, OP_INIT_ALLOC, OP_INIT_SEGMENT, OP_MARK, OP_NAMES, OP_OOM, OP_SEG_FREE,
                     OP_SEG_HINT, MAX_REQUEST)
from ..vocab import OP_PAUSE, OP_REGION, OP_RESUME  # noqa: F401  (tagged regions: docs/colocated.md)

# Pool kinds carried by segment events in ``cat``.
POOL_SMALL, POOL_LARGE = 0, 1

MAGIC = b"NPTRACE1"
PLAN_MAGIC = b"NPUPLAN\x00"  # plan files (npu_pool.planner.planfile); here so that each kind of file knows the other
# Column name -> array typecode. Order is the on-disk order.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("op", "B"), ("cat", "B"), ("site", "i"), ("id", "q"), ("size", "Q"), ("stream", "q"), ("addr", "Q"),
)
_EVENT_BYTES = sum(array.array(code).itemsize for _, code in COLUMNS)  # one event across every column


def is_count(x: Any) -> bool:
    """Whether ``x`` is a whole number a trace's meta may hold as a count or a byte size: an int
    (not a bool) in 0..2^63-1."""
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 63


def _check_column(col: str, code: str, data: Any) -> None:
    """TraceError unless ``data`` is a contiguous buffer of ``code``'s items (array('Q') for size,
    or a numpy array of that width and sign): the core reads its bytes as those."""
    want = array.array(code)
    try:
        view = memoryview(data)
    except TypeError:
        raise TraceError(f"column {col!r} is a {type(data).__name__}, not a buffer of numbers; "
                         f"a trace column is array({code!r})") from None
    order, fmt = (view.format[0], view.format[1:]) if view.format[:1] in "@=<>!" else ("", view.format)
    native = order in ("", "@", "=") or order == ("<" if sys.byteorder == "little" else ">") or (
        order == "!" and sys.byteorder == "big")
    same = (view.itemsize == want.itemsize and len(fmt) == 1 and fmt.isalpha()
            and fmt.isupper() == code.isupper() and fmt.lower() in "bhilq")
    if not same or not native:
        raise TraceError(f"column {col!r} holds {view.format or '?'} items of {view.itemsize} bytes; a trace column is "
                         f"array({code!r}) ({want.itemsize}-byte {'unsigned' if code.isupper() else 'signed'}, "
                         f"{sys.byteorder}-endian)")
    if not view.c_contiguous or view.ndim != 1:
        raise TraceError(f"column {col!r} is not one contiguous row of items (a strided or {view.ndim}-d view); "
                         "copy it into an array first")


DEVICE_TYPES = ("npu", "cuda")  # runtimes whose request rules a replay applies (npu_pool.vocab.DEVICES)
_forced: list[str] = []         # forced_device blocks, innermost last


def _check_device(device: str) -> str:
    if device not in DEVICE_TYPES:
        raise ValueError(f"unknown device {device!r}; choose one of {', '.join(DEVICE_TYPES)}")
    return device


@contextmanager
def forced_device(device: str | None) -> Iterator[None]:
    """Inside the block every replay of this process applies ``device``'s request rules whatever
    its trace says (the commands' ``--device``); None changes nothing."""
    if device is None:
        yield
        return
    _forced.append(_check_device(device))
    try:
        yield
    finally:
        _forced.pop()


def device_type(trace: "Trace", override: str | None = None) -> str:
    """The runtime whose request rules a replay of ``trace`` applies: ``override`` when given, else
    the innermost :func:`forced_device`, else the trace's ``meta["device_type"]``, else ``"cuda"``
    (no padding: what a trace that does not say how it was recorded has always been replayed with)."""
    if override is not None:
        return _check_device(override)
    if _forced:
        return _forced[-1]
    recorded = trace.meta.get("device_type") if isinstance(trace.meta, dict) else None
    return recorded if recorded in DEVICE_TYPES else "cuda"


_HEADER_FIELDS = ("meta", "n", "byteorder", "columns", "crc32")


def _crc(meta: dict, columns: list[bytes]) -> int:
    """CRC-32 of a trace's metadata (as JSON) and its columns' bytes, as a file stores them."""
    crc = zlib.crc32(json.dumps(meta).encode())
    for data in columns:
        crc = zlib.crc32(data, crc)
    return crc


class TraceError(ValueError):
    """A trace file or trace object is malformed; the message says where and why."""


class Event(NamedTuple):
    op: int
    cat: int
    site: int
    id: int
    size: int
    stream: int
    addr: int


@dataclass
class Trace:
    """One device's events in columns. ``meta`` is JSON-serialisable.

    Well-known ``meta`` keys: ``origin`` (where it came from), ``device`` (int),
    ``sites`` (list of strings; ``site`` indexes it), ``n_ids`` (ids are 0..n_ids-1),
    ``allocator_settings`` (recorded allocator config), ``expandable_segments`` (bool).
    """

    meta: dict[str, Any] = field(default_factory=dict)
    op: array.array = field(default_factory=lambda: array.array("B"))
    cat: array.array = field(default_factory=lambda: array.array("B"))
    site: array.array = field(default_factory=lambda: array.array("i"))
    id: array.array = field(default_factory=lambda: array.array("q"))
    size: array.array = field(default_factory=lambda: array.array("Q"))
    stream: array.array = field(default_factory=lambda: array.array("q"))
    addr: array.array = field(default_factory=lambda: array.array("Q"))

    def __len__(self) -> int:
        return len(self.op)

    def append(self, op: int, *, id: int = -1, size: int = 0, stream: int = 0, site: int = -1,
               cat: int = 0, addr: int = 0) -> None:
        """Append one event (slow path, for builders and tests)."""
        self.op.append(op); self.cat.append(cat); self.site.append(site); self.id.append(id)
        self.size.append(size); self.stream.append(stream); self.addr.append(addr)

    def events(self) -> Iterator[Event]:
        """Iterate events as tuples (slow path, for analysis in Python)."""
        return map(Event._make, zip(self.op, self.cat, self.site, self.id, self.size, self.stream, self.addr))

    @property
    def n_ids(self) -> int:
        return int(self.meta.get("n_ids", 0))

    def validate(self, name: str = "trace") -> None:
        """Check every rule replay and the tools rely on; raise TraceError naming ``name`` and the
        first bad event: column lengths, ops, categories and markers in range, ids dense and each
        allocated once and freed once while live (at its alloc's size), sizes of allocations
        1..2^48, ``init_*`` events first, sites indexing ``meta["sites"]``, ``n_ids`` no more than
        the allocations, ``meta["device_type"]`` a known runtime or absent, ``meta["ooms"]`` well
        formed (:meth:`ooms`)."""
        n = len(self.op)
        for col, _ in COLUMNS:
            if len(getattr(self, col)) != n:
                raise TraceError(f"{name}: column {col!r} has {len(getattr(self, col))} entries, expected {n}")
        if not isinstance(self.meta, dict):
            raise TraceError(f"{name}: meta should be a dict, got {type(self.meta).__name__}")
        sites = self.meta.get("sites", [])
        if not isinstance(sites, list) or not all(isinstance(x, str) for x in sites):
            raise TraceError(f"{name}: meta['sites'] should be a list of strings")
        n_ids = self.meta.get("n_ids", 0)
        if isinstance(n_ids, bool) or not isinstance(n_ids, int) or not 0 <= n_ids < 1 << 63:
            raise TraceError(f"{name}: meta['n_ids'] is {n_ids!r:.40}; it must be the number of allocation ids")
        expandable = self.meta.get("expandable_segments", False)
        if not isinstance(expandable, bool):  # ("no" would read as true)
            raise TraceError(f"{name}: meta['expandable_segments'] is {expandable!r:.40}; it must be true or false")
        device = self.meta.get("device_type")
        if device is not None and device not in DEVICE_TYPES:  # (replays would apply CUDA's rules, saying nothing)
            raise TraceError(f"{name}: meta['device_type'] is {device!r:.40}; it must be one of "
                             f"{', '.join(map(repr, DEVICE_TYPES))}, or absent when unknown")
        try:
            self.ooms()
            inp, keep = self.c_columns()
        except TraceError as e:
            raise TraceError(f"{name}: {e}") from None
        bad = ffi.new("uint64_t *")
        if lib.np_trace_validate(inp, len(sites), bad) != 0:
            raise TraceError(f"{name}: {ffi.string(lib.np_last_error()).decode(errors='replace')}")

    def ooms(self) -> list[dict[str, int]]:
        """The recorded run's failed requests (``meta["ooms"]``: event, size, device_free, whole
        numbers; an entry without an event is left out); TraceError when malformed, or when an
        entry's event is not a failed request (``OP_OOM``) of its size, or its device_free is
        more than any device has (2^48 bytes)."""
        ooms = self.meta.get("ooms", []) if isinstance(self.meta, dict) else []
        keys = ("event", "size", "device_free")
        if not (isinstance(ooms, list) and all(isinstance(o, dict) and all(is_count(o.get(k, 0)) for k in keys)
                                               for o in ooms)):
            raise TraceError("meta['ooms'] is malformed (a list of {event, size, device_free} whole numbers)")
        out = [{k: o.get(k, 0) for k in keys} for o in ooms if "event" in o]
        for k, o in enumerate(out):
            i = o["event"]
            if not (i < len(self.op) and self.op[i] == OP_OOM and self.size[i] == o["size"]):
                raise TraceError(f"meta['ooms'] entry {k}: event {i} is not a failed request (an oom event) of "
                                 f"{o['size']} bytes; the trace has {len(self.op)} events")
            if o["device_free"] > MAX_REQUEST:
                raise TraceError(f"meta['ooms'] entry {k}: device_free {o['device_free']} is more than any "
                                 "device has (2^48 bytes)")
        return out

    def c_columns(self) -> tuple[Any, list[Any]]:
        """The columns as the core's ``np_replay_in`` (ids 0..n_ids-1), and the buffers it points
        into (keep them alive while the struct is used)."""
        inp = ffi.new("np_replay_in *")
        keep: list[Any] = [inp]
        for col, code in COLUMNS:
            data = getattr(self, col)
            _check_column(col, code, data)
            ctype = {"B": "uint8_t[]", "i": "int32_t[]", "q": "int64_t[]", "Q": "uint64_t[]"}[code]
            buf = ffi.from_buffer(ctype, data) if len(data) else ffi.new(ctype, 1)
            keep.append(buf)
            setattr(inp, col, buf)
        inp.n = len(self.op)
        n_ids = self.meta.get("n_ids", 0) if isinstance(self.meta, dict) else 0
        inp.n_ids = n_ids if isinstance(n_ids, int) and 0 <= n_ids < 1 << 63 else 0
        return inp, keep

    # -- file I/O -------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Write the trace: magic, header length, JSON header (with a CRC-32 of the metadata and the
        columns), then each column's bytes."""
        columns = []
        for name, _ in COLUMNS:
            col = getattr(self, name)
            if col.itemsize and sys.byteorder != "little":
                col = array.array(col.typecode, col); col.byteswap()
            columns.append(col.tobytes())
        header = json.dumps({"meta": self.meta, "n": len(self.op), "byteorder": "little",
                             "columns": [c for c, _ in COLUMNS],
                             "crc32": _crc(json.loads(json.dumps(self.meta)), columns)}).encode()
        from ..outputs import output

        with output(path) as f:  # whole or absent
            f.write(MAGIC + struct.pack("<Q", len(header)) + header)
            for data in columns:
                f.write(data)

    @classmethod
    def load(cls, path: str | Path, *, check: bool = True) -> "Trace":
        """Read (and, with ``check``, validate) a trace written by :meth:`save`; TraceError naming
        the file on anything else. Every count is checked against the file's size before anything
        is allocated for it."""
        try:
            with open(path, "rb") as f:
                t = cls._read(f, str(path), os.fstat(f.fileno()).st_size)
        except OSError as e:
            raise TraceError(f"{path}: cannot read ({e.strerror or e})") from None
        if check:
            t.validate(str(path))
        return t

    @classmethod
    def _read(cls, f: BinaryIO, name: str, file_size: int) -> "Trace":
        head = f.read(16)
        if len(head) < 16 or head[:8] != MAGIC:
            cut = len(head) < 16 and head[:8] == MAGIC[:len(head[:8])]  # the start of a trace, and no more
            what = ("empty file: truncated, or never written" if not head else
                    f"truncated: {len(head)} bytes, not even a header" if cut else
                    "an npu_pool trace of another format version" if head[:7] == MAGIC[:7] else "bad magic")
            raise TraceError(f"{name}: not an npu_pool trace ({what})")
        (hlen,) = struct.unpack("<Q", head[8:])
        if hlen > file_size - 16:
            raise TraceError(f"{name}: header length {hlen} runs past the end of the {file_size}-byte file")
        try:
            header = json.loads(f.read(hlen))
        except RecursionError:
            raise TraceError(f"{name}: corrupt header (JSON nested too deeply)") from None
        except ValueError as e:
            raise TraceError(f"{name}: corrupt header ({e})") from None
        if not isinstance(header, dict):
            raise TraceError(f"{name}: corrupt header (a {type(header).__name__}, not an object)")
        unknown = sorted(str(k) for k in header if k not in _HEADER_FIELDS)
        if unknown:  # (a changed byte in a field's name would otherwise drop the field silently)
            raise TraceError(f"{name}: corrupt header (unknown field {unknown[0][:40]!r})")
        n = header.get("n")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise TraceError(f"{name}: corrupt header (event count n={n!r:.40})")
        body = file_size - 16 - hlen
        if n * _EVENT_BYTES != body:
            raise TraceError(f"{name}: the header says {n} events ({n * _EVENT_BYTES} bytes of columns), "
                             f"but {body} bytes follow it: truncated or corrupt")
        if header.get("byteorder", "little") != "little":
            raise TraceError(f"{name}: byte order {header.get('byteorder')!r:.20}; npu_pool traces are little-endian")
        columns = header.get("columns", [c for c, _ in COLUMNS])
        if columns != [c for c, _ in COLUMNS]:
            raise TraceError(f"{name}: columns {columns!r:.120}; this npu_pool reads {[c for c, _ in COLUMNS]}")
        meta = header.get("meta", {})
        if not isinstance(meta, dict):
            raise TraceError(f"{name}: corrupt header (meta is a {type(meta).__name__}, not an object)")
        crc = header.get("crc32")  # (files written before 2026-11-26 have none)
        if crc is not None and (isinstance(crc, bool) or not isinstance(crc, int)):
            raise TraceError(f"{name}: corrupt header (crc32={crc!r:.40})")
        t = cls(meta=meta)
        raw = []
        for cname, code in COLUMNS:
            col = array.array(code)
            raw.append(f.read(n * col.itemsize))
            col.frombytes(raw[-1])
            if sys.byteorder != "little":
                col.byteswap()
            setattr(t, cname, col)
        if crc is not None and _crc(meta, raw) != crc:
            raise TraceError(f"{name}: corrupt (its checksum does not match its contents: a changed byte)")
        return t
