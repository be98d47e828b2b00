"""Plan files (``.npplan``): a versioned header, then one row per position of the iteration.

==========  =========  ===========================================================
bytes       type       content
==========  =========  ===========================================================
8           magic      ``NPUPLAN\\0``
4           u32        format version (``VERSION``)
4           u32        CRC-32 of everything after these 16 bytes
8           u64        header length H
H           JSON       ``{"positions": n, "loop": m, "region": bytes, "align": 512,
                       "flags": f, "row": "<IIQQ", "meta": {...}}`` (positions [0, m): the
                       prologue, run once; [m, n): the loop body)
n x 24      rows       position u32 (0..n-1 in order), end u32 (the position it is freed
                       at, past n: wraps to m + end - n in the next pass; 0xFFFFFFFF: unplanned),
                       requested size u64, offset u64 (2**64-1: unplanned)
==========  =========  ===========================================================

All integers little-endian. ``load_plan`` raises PlanError naming the file on a bad
magic (and says so when the file is a trace), an unknown version, a checksum
mismatch, a short or long file, rows out of order, and an inconsistent or
overlapping plan (it verifies what it reads).
"""
from __future__ import annotations

import array
import json
import os
import struct
import zlib
from pathlib import Path

from ..inputs import NotRegularFile, open_regular
from ..trace.format import MAGIC as TRACE_MAGIC, PLAN_MAGIC
from ..vocab import MAX_REQUEST, PLAN_FLAGS
from .plan import ALIGN, NONE, Plan, PlanError
from .verify import verify

__all__ = ["MAGIC", "VERSION", "save_plan", "load_plan", "plan_bytes", "plan_from_bytes"]

MAGIC = PLAN_MAGIC
VERSION = 1
_ROW = struct.Struct("<IIQQ")
_NO_END = 0xFFFFFFFF


def plan_bytes(plan: Plan) -> bytes:
    """The file image of ``plan``."""
    n = plan.n
    if n >= _NO_END or any(e != NONE and e >= _NO_END for e in plan.end):
        raise PlanError(f"plan: {n} positions are too many for format version {VERSION}")
    header = json.dumps({"positions": n, "loop": plan.loop, "region": plan.region, "align": ALIGN, "flags": plan.flags,
                         "row": "<IIQQ", "meta": plan.meta}).encode()
    rows = bytearray(_ROW.size * n)
    for p in range(n):
        e = plan.end[p]
        _ROW.pack_into(rows, p * _ROW.size, p, _NO_END if e == NONE else e, plan.size[p], plan.offset[p])
    body = struct.pack("<Q", len(header)) + header + bytes(rows)
    return MAGIC + struct.pack("<II", VERSION, zlib.crc32(body)) + body


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write ``plan`` to ``path``, whole or not at all (verify it first: make_plan's plans already are)."""
    from ..outputs import write_bytes

    write_bytes(path, plan_bytes(plan))


def plan_from_bytes(data: bytes, name: str = "<plan>") -> Plan:
    """Parse and verify a plan file image; PlanError naming ``name`` when it is not one."""
    if len(data) < 24 or data[:8] != MAGIC:
        what = ("an npu_pool trace, not a plan" if data[:8] == TRACE_MAGIC else
                f"truncated ({len(data)} bytes, shorter than a plan's header)" if data[:8] == MAGIC else
                "not an npu_pool plan (bad magic)")
        raise PlanError(f"{name}: {what}")
    version, crc = struct.unpack_from("<II", data, 8)
    if version != VERSION:
        raise PlanError(f"{name}: plan format version {version}; this npu_pool reads version {VERSION}")
    body = memoryview(data)[16:]
    if zlib.crc32(body) != crc:
        raise PlanError(f"{name}: checksum mismatch: the file is corrupt or truncated")
    (hlen,) = struct.unpack_from("<Q", body, 0)
    if hlen > len(body) - 8:
        raise PlanError(f"{name}: header length {hlen} runs past the end of the file")
    try:
        head = json.loads(bytes(body[8:8 + hlen]))
        n, region, flags = head["positions"], head["region"], head.get("flags", 0)
        loop, meta = head.get("loop", 0), head.get("meta", {})
    except RecursionError:
        raise PlanError(f"{name}: corrupt header (JSON nested too deeply)") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise PlanError(f"{name}: corrupt header ({e})") from None
    for key, value, hi in (("positions", n, _NO_END - 1), ("region", region, MAX_REQUEST), ("flags", flags, PLAN_FLAGS),
                           ("loop", loop, _NO_END - 1)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= hi:
            raise PlanError(f"{name}: corrupt header ({key} is {value!r:.40}, expected an int in 0..{hi})")
    if not isinstance(meta, dict):
        raise PlanError(f"{name}: corrupt header (meta is a {type(meta).__name__}, not an object)")
    if head.get("align", ALIGN) != ALIGN or head.get("row", "<IIQQ") != "<IIQQ":
        raise PlanError(f"{name}: unsupported layout (align {head.get('align')}, row {head.get('row')!r})")
    rows = body[8 + hlen:]
    if n < 0 or len(rows) != n * _ROW.size:
        raise PlanError(f"{name}: {len(rows)} bytes of rows, expected {n} x {_ROW.size}")
    size, offset, end = array.array("Q"), array.array("Q"), array.array("Q")
    for p, (pos, e, s, o) in enumerate(_ROW.iter_unpack(rows)):
        if pos != p:
            raise PlanError(f"{name}: row {p} holds position {pos}; rows must list positions 0..{n - 1} in order")
        size.append(s)
        offset.append(o)
        end.append(NONE if e == _NO_END else e)
    plan = Plan(size, offset, end, region, loop, flags, meta)
    try:
        verify(plan)
    except PlanError as e:
        raise PlanError(f"{name}: {e}") from None
    return plan


_MAX_HEADER = 1 << 24  # a plan's JSON header is a few KiB (its meta); more is no plan


def load_plan(path: str | Path) -> Plan:
    """Read and verify the plan file at ``path``. Only a regular file is read; its first
    bytes are checked (a trace or any other file is refused at once, naming what it is), and
    the rest is read only when the header's counts match the file's size."""
    try:
        with open_regular(path) as f:
            st = os.fstat(f.fileno())
            head = f.read(24)
            if len(head) < 24 or head[:8] != MAGIC:
                plan_from_bytes(head, str(path))  # raises, naming what the file is
            (hlen,) = struct.unpack_from("<Q", head, 16)
            if hlen > min(_MAX_HEADER, st.st_size - 24):
                raise PlanError(f"{path}: header length {hlen} runs past the end of the file")
            data = head + f.read(hlen)
            try:
                n = json.loads(data[24:]).get("positions")
            except (ValueError, AttributeError, RecursionError):
                n = None  # plan_from_bytes names the problem
            if isinstance(n, int) and not isinstance(n, bool) and n >= 0 and st.st_size != 24 + hlen + n * _ROW.size:
                raise PlanError(f"{path}: {st.st_size - 24 - hlen} bytes of rows, expected {n} x {_ROW.size}: "
                                "truncated or corrupt")
            data += f.read(st.st_size - len(data))
    except NotRegularFile as e:
        raise PlanError(f"{path}: not a regular file ({e.kind}); give a plan file") from None
    except OSError as e:
        raise PlanError(f"{path}: cannot read ({e.strerror or e})") from None
    return plan_from_bytes(data, str(path))
