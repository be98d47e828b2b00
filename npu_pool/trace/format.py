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
``OP_FREE``           ``id`` of a live allocation; other fields copy the alloc's
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
====================  ============================================================

All ``OP_INIT_*`` events come first, segments then allocations, both in address order.
"""
from __future__ import annotations

import array
import json
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterator, NamedTuple

# Ops, categories and markers are the core's vocabulary (npu_pool.h), defined once there.
from ..vocab import (CAT_ACTIVATION, CAT_AUTOGRAD_DETAIL, CAT_GRADIENT, CAT_INPUT, CAT_NAMES,  # noqa: F401
                     CAT_OPTIMIZER_STATE, CAT_PARAMETER, CAT_TEMPORARY, CAT_UNKNOWN, MARK_BACKWARD_BEGIN,
                     MARK_BACKWARD_END, MARK_EVAL_BEGIN, MARK_EVAL_END, MARK_FORWARD_BEGIN, MARK_FORWARD_END,
                     MARK_ITER_BEGIN, MARK_ITER_END, MARK_LAYER_ENTER, MARK_LAYER_EXIT, MARK_NAMES,
                     MARK_OPTIMIZER_BEGIN, MARK_OPTIMIZER_END, MARK_SETUP_BEGIN, MARK_SETUP_END, OP_ALLOC,
                     OP_EMPTY_CACHE, OP_FREE, OP_INIT_ALLOC, OP_INIT_SEGMENT, OP_MARK, OP_NAMES, OP_OOM, OP_SEG_FREE,
                     OP_SEG_HINT)

# Pool kinds carried by segment events in ``cat``.
POOL_SMALL, POOL_LARGE = 0, 1

MAGIC = b"NPTRACE1"
# Column name -> array typecode. Order is the on-disk order.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("op", "B"), ("cat", "B"), ("site", "i"), ("id", "q"), ("size", "Q"), ("stream", "q"), ("addr", "Q"),
)


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

    def validate(self) -> None:
        """Check the invariants replay relies on; raise TraceError naming the first bad event."""
        n = len(self.op)
        for name, _ in COLUMNS:
            if len(getattr(self, name)) != n:
                raise TraceError(f"column {name!r} has {len(getattr(self, name))} entries, expected {n}")
        n_ids = self.n_ids
        live = bytearray(n_ids)  # 0 never seen, 1 live, 2 freed
        for i, (op, id_) in enumerate(zip(self.op, self.id)):
            if op in (OP_ALLOC, OP_INIT_ALLOC):
                if not 0 <= id_ < n_ids:
                    raise TraceError(f"event {i}: alloc id {id_} outside 0..{n_ids - 1}")
                if live[id_]:
                    raise TraceError(f"event {i}: id {id_} allocated twice")
                live[id_] = 1
            elif op == OP_FREE:
                if not 0 <= id_ < n_ids or live[id_] != 1:
                    raise TraceError(f"event {i}: free of id {id_} which is not live")
                live[id_] = 2
            elif op >= len(OP_NAMES):
                raise TraceError(f"event {i}: unknown op {op}")

    # -- file I/O -------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Write the trace: magic, header length, JSON header, then each column's bytes."""
        header = json.dumps({"meta": self.meta, "n": len(self.op), "byteorder": "little",
                             "columns": [c for c, _ in COLUMNS]}).encode()
        with open(path, "wb") as f:
            f.write(MAGIC + struct.pack("<Q", len(header)) + header)
            for name, _ in COLUMNS:
                col = getattr(self, name)
                if col.itemsize and sys.byteorder != "little":
                    col = array.array(col.typecode, col); col.byteswap()
                f.write(col.tobytes())

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        """Read a trace written by :meth:`save`; TraceError on anything else."""
        with open(path, "rb") as f:
            return cls._read(f, str(path))

    @classmethod
    def _read(cls, f: BinaryIO, name: str) -> "Trace":
        head = f.read(16)
        if len(head) < 16 or head[:8] != MAGIC:
            raise TraceError(f"{name}: not an npu_pool trace (bad magic)")
        (hlen,) = struct.unpack("<Q", head[8:])
        if hlen > 1 << 31:
            raise TraceError(f"{name}: header length {hlen} is absurd; file is corrupt")
        try:
            header = json.loads(f.read(hlen))
            n = int(header["n"])
        except (ValueError, KeyError, TypeError) as e:
            raise TraceError(f"{name}: corrupt header ({e})") from None
        t = cls(meta=header.get("meta", {}))
        for cname, code in COLUMNS:
            col = array.array(code)
            nbytes = n * col.itemsize
            data = f.read(nbytes)
            if len(data) != nbytes:
                raise TraceError(f"{name}: truncated in column {cname!r} ({len(data)} of {nbytes} bytes)")
            col.frombytes(data)
            if sys.byteorder != "little":
                col.byteswap()
            setattr(t, cname, col)
        if f.read(1):
            raise TraceError(f"{name}: trailing bytes after the last column")
        return t
