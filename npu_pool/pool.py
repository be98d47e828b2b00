"""The Python face of the C core: :class:`Pool` (one allocator context) and its errors.

The bottom of the package's import graph: it imports the binding, the vocabulary, the
fork-safe lock and the OOM snapshot writer (which import nothing above them), nothing else.
"""
from __future__ import annotations

import array
import os
import threading
import weakref
from typing import Any, NamedTuple, Optional, Sequence, Union

from . import oom
from .locks import ForkSafeLock
from ._core import ffi, lib
from .vocab import BACKENDS as _BACKEND_NAMES, CALL_NAMES, HISTORY_MAX, LIFETIMES as _LIFE_NAMES, MARK_NAMES
from .vocab import DEVICES as _DEVICE_NAMES, PLAN_FLAGS
from .vocab import POLICIES as _POLICY_NAMES, POOL_NAMES

POLICIES: dict[str, int] = {name: i for i, name in enumerate(_POLICY_NAMES)}
BACKENDS: dict[str, int] = {name: i for i, name in enumerate(_BACKEND_NAMES)}
LIFETIMES: dict[str, int] = {name: i for i, name in enumerate(_LIFE_NAMES)}
DEVICE_RULES: dict[str, int] = {name: i for i, name in enumerate(_DEVICE_NAMES)}
GiB = 1 << 30
PLAN_COUNTS = ("served", "fallback", "idle", "resyncs")  # np_set_plan's counters, in order
_U64 = (1 << 64) - 1
_I64 = (-(1 << 63), (1 << 63) - 1)

__all__ = ["Pool", "PoolView", "PoolError", "OutOfMemoryError", "InvalidArgumentError", "DoubleFreeError",
           "UnknownPointerError", "BackendError", "POLICIES", "BACKENDS", "LIFETIMES", "POOL_NAMES", "PLAN_COUNTS"]


class PoolError(RuntimeError):
    """An allocator call failed; ``code`` is the core's NP_ERR_* value."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class OutOfMemoryError(PoolError, MemoryError):
    """The device, or the fraction cap, has no room for the request."""


class InvalidArgumentError(PoolError, ValueError):
    """A bad argument: size 0, absurd size, bad fraction, unknown name, a number outside 64 bits."""


class DoubleFreeError(PoolError):
    """The pointer lies in this pool's memory but is no allocated block: freed already (a double
    free), or an address inside a tensor rather than its start."""


class UnknownPointerError(PoolError):
    """The pointer was never handed out by this pool."""


class BackendError(PoolError):
    """The vendor runtime failed (the message names the call); the pool's books still match the device."""


_ERRORS: dict[int, type[PoolError]] = {lib.NP_ERR_OOM: OutOfMemoryError, lib.NP_ERR_DOUBLE_FREE: DoubleFreeError,
                                       lib.NP_ERR_UNKNOWN_PTR: UnknownPointerError,
                                       lib.NP_ERR_INVALID: InvalidArgumentError, lib.NP_ERR_BACKEND: BackendError}


def _raise(code: int) -> None:
    message = ffi.string(lib.np_last_error()).decode(errors="replace")
    raise _ERRORS.get(code, PoolError)(code, message)


def _check(code: int) -> None:
    if code != lib.NP_OK:
        _raise(code)


def _invalid(message: str) -> InvalidArgumentError:
    return InvalidArgumentError(lib.NP_ERR_INVALID, message)


def _lookup(table: dict[str, int], value: object, what: str) -> int:
    try:
        return table[value]  # type: ignore[index]
    except (KeyError, TypeError):
        raise _invalid(f"unknown {what} {value!r}; choose one of {', '.join(table)}") from None


def _flag(value: object, what: str) -> bool:
    """``value`` if it is a bool (``vmm="no"`` would be true)."""
    if not isinstance(value, bool):
        raise _invalid(f"{what} must be True or False, got {value!r}")
    return value


def _uint(value: object, what: str, maximum: int = _U64) -> int:
    """``value`` as an unsigned integer of at most 64 bits (never a silent wrap-around)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(f"{what} must be an int, got {value!r}")
    if not 0 <= value <= maximum:
        raise _invalid(f"{what} {value} is outside 0..{maximum}")
    return value


def _int(value: object, what: str) -> int:
    """``value`` as a signed 64-bit integer (streams, sites, marker arguments)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(f"{what} must be an int, got {value!r}")
    if not _I64[0] <= value <= _I64[1]:
        raise _invalid(f"{what} {value} is outside the signed 64-bit range")
    return value


def _fraction(value: object) -> float:
    """A memory fraction as the core takes it (the core checks the range: (0, 1])."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _invalid(f"fraction must be a number in (0, 1], got {value!r:.80}")
    try:
        return float(value)
    except OverflowError:  # (an int past what a float holds: no fraction)
        raise _invalid(f"fraction must be a number in (0, 1], got {value!r:.80}") from None


def _lib_path(value: object) -> bytes:
    """A vendor library's path as the core takes it (bytes, as the file system names it)."""
    # (the core reads "a\0b" as "a"; "" and ":" -- CUDA's RUNTIME:DRIVER, both left out -- as the default library)
    if not isinstance(value, str) or "\0" in value or not value.strip(":"):
        raise _invalid(f"lib_path must be a path (a non-empty str without NUL characters; None for the default "
                       f"library), got {value!r:.80}")
    return os.fsencode(value)


def _u64_column(values: Sequence[int], what: str) -> array.array:
    """``values`` as an ``array('Q')`` (as given when it is one), never wrapped around."""
    if isinstance(values, array.array) and values.typecode == "Q":
        return values
    try:
        return array.array("Q", values)
    except (OverflowError, TypeError) as e:
        raise _invalid(f"{what}: every entry must be an int in 0..2^64-1 ({e})") from None


def _event_layout() -> tuple[Any, tuple[str, ...]]:
    """A struct.Struct reading one np_event_info from its bytes, and the field names in order."""
    import struct

    codes = {"uint64_t": "Q", "int64_t": "q", "int32_t": "i", "uint8_t": "B"}
    t = ffi.typeof("np_event_info")
    fmt, at, names = "=", 0, []  # native byte order, no padding but the struct's own
    for name, f in t.fields:
        fmt += "x" * (f.offset - at) + codes[f.type.cname]
        at = f.offset + ffi.sizeof(f.type)
        names.append(name)
    fmt += "x" * (ffi.sizeof(t) - at)
    return struct.Struct(fmt), tuple(names)


# (made once at import: made at first use, two threads' first histories could both add to it,
# and every later history() failed)
_EVENT_LAYOUT = _event_layout()


def _event_dicts(buf: Any, n: int, kinds: Any) -> list[dict[str, Any]]:
    """The first ``n`` np_event_info of ``buf`` as dicts (``kind`` by name), read from their
    bytes at once: a failing request converts the history it reports without a per-field call."""
    layout, names = _EVENT_LAYOUT
    k = names.index("kind")
    out = []
    for row in layout.iter_unpack(ffi.buffer(buf, n * layout.size)):
        d = dict(zip(names, row))
        d["kind"] = kinds[row[k]]
        out.append(d)
    return out


def _block_dicts(buf: Any, n: int) -> list[dict[str, Any]]:
    """The first ``n`` np_block_info of ``buf`` as dicts."""
    return [_as_dict(buf[i]) for i in range(n)]


def _ranges(buf: Any, n: int) -> list[tuple[int, int]]:
    """The first ``n`` (address, size) pairs of ``buf``."""
    return [(int(buf[2 * i]), int(buf[2 * i + 1])) for i in range(n)]


def _calls(counts: Any) -> dict[str, int]:
    """Device calls by kind, ``{name: count}`` in the vocabulary's order (``vocab.CALL_NAMES``)."""
    return {name: int(counts[k]) for k, name in enumerate(CALL_NAMES)}


def _as_dict(obj: Any) -> Any:
    """Convert a cffi struct (nested) into plain dicts."""
    if not isinstance(obj, ffi.CData):
        return obj
    t = ffi.typeof(obj)
    if t.kind == "struct":
        return {name: _as_dict(getattr(obj, name)) for name, _ in t.fields}
    if t.kind == "array":
        if t.item.cname == "char":
            return ffi.string(obj).decode(errors="replace")
        return [_as_dict(x) for x in obj]
    return obj


class PoolView(NamedTuple):
    """A pool read at one instant (:meth:`Pool.view`): what its four readings return."""

    stats: dict[str, Any]
    blocks: list[dict[str, Any]]
    mapped_ranges: list[tuple[int, int]]
    history: list[dict[str, Any]]


class Pool:
    """One allocator context over one (simulated or real) device.

    ``policy``: ``"npu_pool"`` (one arena, lifetime-aware placement), ``"torch"`` (a model of
    PyTorch's caching allocator), ``"expandable"`` (PyTorch's expandable segments) or
    ``"planned"`` (a plan made offline; ``npu_pool.planner.install``). ``capacity`` is the
    simulated device's memory; ``host_backed`` puts real host memory behind it; ``vmm`` lets
    memory grow in chunks mapped as needed where the backend can map memory. ``rules``: whose request rules
    apply -- ``"npu"`` (torch_npu's: every request rounds up to 32 bytes and gets 32 more),
    ``"cuda"`` (none) or ``"auto"`` (the backend's own: ACL pads where torch_npu does).
    ``compact``: :meth:`set_compaction` from the start.
    """

    def __init__(self, policy: str = "npu_pool", capacity: int = 64 * GiB, backend: str = "sim", *,
                 host_backed: bool = False, vmm: bool = True, fraction: float = 1.0,
                 max_split_size: Optional[int] = None, device: int = 0, lib_path: Optional[str] = None,
                 rules: str = "auto", compact: bool = False):
        self._ctx = None
        cfg = ffi.new("np_config *")
        lib.np_config_init(cfg)
        cfg.policy = _lookup(POLICIES, policy, "policy")
        cfg.backend = _lookup(BACKENDS, backend, "backend")
        if _uint(capacity, "capacity") == 0:
            raise _invalid("capacity must be a positive number of bytes, got 0")
        cfg.capacity = capacity
        cfg.host_backed = _flag(host_backed, "host_backed")
        cfg.vmm = _flag(vmm, "vmm")
        cfg.fraction = _fraction(fraction)
        # (None: unset; 0, 0.0, False or "" were taken as unset too, where every other argument refuses them)
        cfg.max_split_size = 0 if max_split_size is None else _uint(max_split_size, "max_split_size")
        if max_split_size is not None and cfg.max_split_size == 0:
            raise _invalid("max_split_size must be more than 20 MiB (as in PyTorch), or None to leave it unset, got 0")
        if cfg.max_split_size and policy != "torch":  # (set and ignored, it would read as a setting that works)
            raise _invalid(f"max_split_size applies to the torch policy only (PyTorch's max_split_size_mb); "
                           f"the {policy} policy splits no segments")
        cfg.device = _uint(device, "device", lib.NP_MAX_DEVICES - 1)
        if lib_path is not None and backend == "sim":  # (given and ignored, it would read as a library in use)
            raise _invalid(f"lib_path names a vendor library; the sim backend loads none, got {lib_path!r:.80}")
        path = ffi.new("char[]", _lib_path(lib_path)) if lib_path is not None else ffi.NULL
        cfg.lib_path = path
        cfg.device_rules = _lookup(DEVICE_RULES, rules, "device rules")
        out = ffi.new("np_ctx **")
        compact = _flag(compact, "compact")
        _check(lib.np_create(cfg, out))
        self._ctx = out[0]
        self.policy = policy
        self.backend = backend
        self.device = device
        self._rules = rules
        if compact:
            try:
                self.set_compaction(True)
            except PoolError:
                self.close()
                raise

    @property
    def device_rules(self) -> str:
        """Whose request rules the pool applies: ``"npu"`` (torch_npu's padding) or ``"cuda"``."""
        rules = getattr(self, "_rules", "auto")  # (the installed allocator's pools: the backend's own)
        return rules if rules != "auto" else "npu" if self.backend == "acl" else "cuda"

    # -- lifetime -----------------------------------------------------------------------
    _closed = False
    _owns = True  # the context is this object's to free (the installed allocator's are not)

    def close(self) -> None:
        """Return all device memory and close the pool (its pointers become invalid).

        Safe while other threads use the pool: the call in flight finishes first, and every call
        after (or racing with) the close raises :class:`PoolError` "closed pool", never touching
        freed memory. Closing twice does nothing. Raises :class:`BackendError` if the device
        refused to take some memory back even after retries (the message says how much; the pool
        is closed either way)."""
        ctx = getattr(self, "_ctx", None)
        if ctx is not None:
            self._closed = True  # (calls from now on are refused here; those in flight finish first)
            _check(lib.np_close(ctx))  # a second close waits for the first one's to return the memory

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __copy__(self) -> "Pool":  # two objects would own (and free) one context
        raise TypeError("a Pool cannot be copied: it owns its device memory; share the object instead")

    def __deepcopy__(self, memo: dict) -> "Pool":
        return self.__copy__()

    def __reduce__(self) -> Any:  # (pickling would copy it too)
        return self.__copy__()

    def __del__(self) -> None:
        # No thread can be inside a method now (each holds a reference): the struct may go.
        ctx = getattr(self, "_ctx", None)
        if ctx is not None and self._owns:
            self._ctx = None
            lib.np_destroy(ctx)  # closes first if close() was never called; a refusal is lost here

    @property
    def ctx(self) -> Any:
        if self._ctx is None or self._closed:
            raise PoolError(lib.NP_ERR_STATE, "closed pool: close() returned its memory; make a new pool")
        return self._ctx

    # -- allocation ---------------------------------------------------------------------
    def malloc(self, size: int, stream: int = 0, lifetime: str = "auto", site: int = -1) -> int:
        """Allocate ``size`` bytes on ``stream``; returns the device address.

        A request the device or the cap cannot hold raises :class:`OutOfMemoryError` with the
        core's explanation (and writes an OOM snapshot when one is asked for: ``npu_pool.oom``)."""
        size = _uint(size, "size")
        stream = _int(stream, "stream")
        site = _int(site, "site")
        if not -1 <= site < (1 << 31):
            raise _invalid(f"site {site} is outside -1..2^31-1")
        out = ffi.new("void **")
        life = _lookup(LIFETIMES, lifetime, "lifetime")
        try:
            _check(lib.np_malloc_ex(self.ctx, size, stream, life, site, out))
        except OutOfMemoryError as e:
            self._on_oom(e, size)
            raise
        return int(ffi.cast("uintptr_t", out[0]))

    def _on_oom(self, e: OutOfMemoryError, size: int) -> None:
        """A failed request of ``size`` bytes: its OOM snapshot when one is asked for, noted in ``e``."""
        note = oom.on_oom(self, size, self.device)
        if note:
            e.args = (f"{e.args[0]}\n{note}",)

    def free(self, ptr: int) -> None:
        """Free an address returned by :meth:`malloc`."""
        _check(lib.np_free(self.ctx, ffi.cast("void *", _uint(ptr, "pointer"))))

    def record_stream(self, ptr: int, stream: int) -> None:
        """torch's ``record_stream``: the block is also used on ``stream``; its memory is not
        reused before that use ends."""
        _check(lib.np_record_stream(self.ctx, ffi.cast("void *", _uint(ptr, "pointer")), _int(stream, "stream")))

    def block_size(self, ptr: int) -> int:
        """Bytes of the block behind an allocated address (requested size rounded)."""
        out = ffi.new("uint64_t *")
        _check(lib.np_block_size(self.ctx, ffi.cast("void *", _uint(ptr, "pointer")), out))
        return int(out[0])

    def empty_cache(self) -> None:
        """Return every cached byte the policy can give back to the device (and retry what the
        device refused before). Raises :class:`BackendError` if the device refuses some of it:
        ``stats()["unreleased"]`` counts what it still holds."""
        _check(lib.np_empty_cache(self.ctx))

    def set_fraction(self, fraction: float) -> None:
        """Cap reserved bytes at ``fraction`` x device memory (0 < fraction <= 1)."""
        _check(lib.np_set_fraction(self.ctx, _fraction(fraction)))

    def set_compaction(self, on: bool) -> None:
        """Compact at an out-of-memory (off by default; docs/api.md): a chunk that holds live blocks
        and free pages is replaced by chunks over its live pages, their bytes copied through host
        memory, before the request fails. Safe only where one thread at a time queues device work."""
        _check(lib.np_set_compaction(self.ctx, _flag(on, "compaction")))

    def compact(self) -> int:
        """Compact now (docs/api.md, Compaction), whether or not :meth:`set_compaction` is on:
        :meth:`empty_cache`, then every chunk that holds live blocks and free pages is replaced by
        chunks over its live pages, their bytes copied through host memory at the same addresses.
        Returns the reserved bytes given back to the device. Call it where no other thread queues
        device work and the memory is wanted elsewhere (after evaluation, before handing it to
        another engine); not every step: the next step maps again what it gives back."""
        out = ffi.new("uint64_t *")
        _check(lib.np_compact(self.ctx, out))
        return int(out[0])

    # -- hints ----------------------------------------------------------------------------
    def set_phase(self, phase: int, default_lifetime: str = "auto") -> None:
        """Set the phase counter and the class of requests whose site has no history."""
        _check(lib.np_set_phase(self.ctx, _uint(phase, "phase", 0xFFFFFFFF),
                                _lookup(LIFETIMES, default_lifetime, "lifetime")))

    def mark(self, code: Union[int, str], arg: int = -1) -> None:
        """Record a phase marker (a ``MARK_*`` code or its name, e.g. ``"setup_begin"``)."""
        if isinstance(code, str):
            code = _lookup({n: i for i, n in enumerate(MARK_NAMES)}, code, "marker")
        _check(lib.np_mark(self.ctx, _uint(code, "marker code", 0x7FFFFFFF), _int(arg, "marker argument")))

    # -- plans ----------------------------------------------------------------------------
    def set_plan(self, size: Sequence[int], offset: Sequence[int], end: Sequence[int], loop: int, region: int,
                 flags: int, outside: int = 0) -> None:
        """Install a plan on a ``"planned"`` pool (the C call; ``npu_pool.planner.install`` makes
        the columns from a plan file). ``size`` empty removes the plan. ``outside``: the bytes the
        plan expects live outside it at once, mapped for the fallback with the region."""
        cols = [_u64_column(c, what) for c, what in ((size, "plan size"), (offset, "plan offset"), (end, "plan end"))]
        n = len(cols[0])
        if not (len(cols[1]) == len(cols[2]) == n):
            raise _invalid("a plan's size, offset and end columns must have the same length")
        bufs = [ffi.from_buffer("uint64_t[]", c) if n else ffi.NULL for c in cols]
        _check(lib.np_set_plan(self.ctx, n, _uint(loop, "plan loop"), bufs[0] if n else ffi.new("uint64_t[]", 1),
                               bufs[1], bufs[2], _uint(region, "plan region"), _uint(outside, "plan outside"),
                               _uint(flags, "plan flags", PLAN_FLAGS), ffi.NULL))

    def plan_counts(self) -> dict[str, int]:
        """Requests of a ``"planned"`` pool served from the plan, fallen back, placed in idle
        ranges, and resynchronisations."""
        out = ffi.new("uint64_t[4]")
        _check(lib.np_set_plan(self.ctx, 0, 0, ffi.NULL, ffi.NULL, ffi.NULL, 0, 0, 0, out))
        return dict(zip(PLAN_COUNTS, (int(x) for x in out)))

    # -- introspection --------------------------------------------------------------------
    def _read_stats(self, st: Any) -> None:
        lib.np_get_stats(self.ctx, st)

    def stats(self) -> dict[str, Any]:
        """Counters of the whole device and of each pool (see docs/api.md)."""
        st = ffi.new("np_stats *")
        self._read_stats(st)
        return self._stats_dict(st)

    def _stats_dict(self, st: Any) -> dict[str, Any]:
        d = _as_dict(st[0])
        d["pools"] = {p.pop("name"): p for p in d.pop("pool")}
        d["total"].pop("name")
        d["policy"] = self.policy
        d["vmm"] = bool(d["vmm"])
        d["compaction"] = bool(d["compaction"])
        d["compactable"] = bool(d["compactable"])
        d["calls"] = _calls(d["calls"])
        return d

    def blocks(self) -> list[dict[str, Any]]:
        """Every block of every segment, in address order (the segment map). Free blocks carry the
        stream they are kept for in ``stream`` when ``tagged`` (else any stream may take them)."""
        n = ffi.new("size_t *")
        _check(lib.np_blocks(self.ctx, ffi.NULL, 0, n))
        while True:
            cap = n[0]
            buf = ffi.new("np_block_info[]", max(cap, 1))
            _check(lib.np_blocks(self.ctx, buf, cap, n))
            if n[0] <= cap:
                return _block_dicts(buf, n[0])

    def mapped_ranges(self) -> list[tuple[int, int]]:
        """``(address, size)`` of every range backed by physical memory, in address order."""
        n = ffi.new("size_t *")
        _check(lib.np_mapped_ranges(self.ctx, ffi.NULL, 0, n))
        while True:
            cap = n[0]
            buf = ffi.new("uint64_t[]", max(2 * cap, 1))
            _check(lib.np_mapped_ranges(self.ctx, buf, cap, n))
            if n[0] <= cap:
                return _ranges(buf, n[0])

    def history(self, limit: Optional[int] = None) -> list[dict[str, Any]]:
        """The pool's latest events (at most the bound of :meth:`set_history`), oldest first:
        ``kind`` alloc, free, segment_alloc/free/map/unmap, empty_cache, oom, mark, hold/unhold
        (device memory kept mapped nowhere: spare chunks, memory the device refused to take back),
        or compact (a chunk replaced by chunks over its live pages; size: the bytes moved)."""
        from .vocab import EVENT_NAMES

        want = _uint(limit, "limit", HISTORY_MAX) if limit is not None else None
        cap = min(want, 1 << 20) if want is not None else 1 << 20  # grown as the history holds more
        n = ffi.new("size_t *")
        while True:
            buf = ffi.new("np_event_info[]", max(cap, 1))
            _check(lib.np_history(self.ctx, buf, cap, n))
            if n[0] < cap or cap == want:
                return _event_dicts(buf, n[0], EVENT_NAMES)
            cap = cap * 4 if want is None else min(cap * 4, want)

    def view(self, history_limit: Optional[int] = None) -> PoolView:
        """:meth:`stats`, :meth:`blocks`, :meth:`mapped_ranges` and :meth:`history` (its latest
        ``history_limit`` events) read at one instant: other threads' requests wait while it is read,
        so that a snapshot taken while they allocate agrees with itself."""
        from .vocab import EVENT_NAMES

        want = _uint(history_limit, "limit", HISTORY_MAX) if history_limit is not None else None
        st, nb, nr, ne = ffi.new("np_stats *"), ffi.new("size_t *"), ffi.new("size_t *"), ffi.new("size_t *")
        bcap = rcap = ecap = 0
        while True:
            bbuf, rbuf = ffi.new("np_block_info[]", max(bcap, 1)), ffi.new("uint64_t[]", max(2 * rcap, 1))
            ebuf = ffi.new("np_event_info[]", max(ecap, 1))
            _check(lib.np_view(self.ctx, st, bbuf, bcap, nb, rbuf, rcap, nr, ebuf, ecap, ne))
            events = ne[0] if want is None else min(ne[0], want)  # (the latest `events` of those kept)
            if nb[0] <= bcap and nr[0] <= rcap and events <= ecap:
                copied = min(ne[0], ecap)
                return PoolView(self._stats_dict(st), _block_dicts(bbuf, nb[0]), _ranges(rbuf, nr[0]),
                                _event_dicts(ebuf + (copied - events), events, EVENT_NAMES))
            # (other threads may add more before the next try: some room to spare)
            bcap, rcap, ecap = (n + n // 8 + 16 for n in (nb[0], nr[0], events))

    def set_history(self, max_entries: int) -> None:
        """Keep the latest ``max_entries`` events (0: none; default 4096); clears the history."""
        _check(lib.np_set_history(self.ctx, _uint(max_entries, "max_entries")))

    def reset_peak(self) -> None:
        """Reset every peak to the current value."""
        lib.np_reset_peak(self.ctx)

    def reset_accumulated(self) -> None:
        """Zero the accumulated figures: each counter's allocated/freed sums, ooms, retries,
        synchronisations, device calls."""
        lib.np_reset_accumulated(self.ctx)

    def forget(self) -> None:
        """Forget what the pool learned from its requests (per-site lifetimes, the phase markers'
        state): later requests are placed as a new pool's would be. Memory and statistics stay.
        For replaying a trace repeatedly on one pool, each run as a first run."""
        _check(lib.np_forget(self.ctx))

    def check(self) -> None:
        """Verify the core's invariants; raises PoolError naming the first violation."""
        _check(lib.np_check(self.ctx))

    # -- tagged regions: pause and resume (docs/colocated.md) ------------------------------
    def region(self, tag: str) -> "_Region":
        """``with pool.region(tag):`` -- requests made inside belong to ``tag`` (its own address
        range; npu_pool policy with a virtual-memory API). Regions nest; the region is the pool's,
        not the thread's, so torch's backward threads allocate into it too."""
        return _Region(self, _tag(tag))

    def pause(self, tag: str, backup: bool = False) -> int:
        """Return ``tag``'s physical memory to the device, keeping its blocks and addresses; with
        ``backup``, first copy their contents to pinned host memory (within the bound of
        :meth:`set_backup_limit`). Returns the bytes given back."""
        out = ffi.new("uint64_t *")
        _check(lib.np_pause(self.ctx, _tag(tag), _flag(backup, "backup"), out))
        return int(out[0])

    def resume(self, tag: str) -> int:
        """Map ``tag``'s blocks again at their addresses (returning the pool's idle memory first if
        the device is short) and restore its backup. Returns the bytes mapped again. A resume the
        device or the cap cannot hold raises :class:`OutOfMemoryError` as :meth:`malloc` does (its
        request: the bytes to map; an OOM snapshot when one is asked for)."""
        out = ffi.new("uint64_t *")
        try:
            _check(lib.np_resume(self.ctx, _tag(tag), out))
        except OutOfMemoryError as e:
            self._on_oom(e, int(self.tags().get(tag, {}).get("paused", 0)) or 1)
            raise
        return int(out[0])

    def tags(self) -> dict[str, dict[str, Any]]:
        """``{tag: {allocated, blocks, mapped, paused, backup, backup_held, pauses, is_paused, current}}``."""
        n = ffi.new("size_t *")
        _check(lib.np_tags(self.ctx, ffi.NULL, 0, n))
        while True:  # (another thread may add a tag between the two calls: ask again with room for it)
            cap = n[0]
            buf = ffi.new("np_tag_info[]", max(cap, 1))
            _check(lib.np_tags(self.ctx, buf, cap, n))
            if n[0] <= cap:
                break
        out = {}
        for i in range(n[0]):
            d = _as_dict(buf[i])
            name = d.pop("name")
            d["is_paused"], d["current"] = bool(d["is_paused"]), bool(d["current"])
            out[name] = d
        return out

    def set_backup_limit(self, nbytes: int) -> None:
        """Bound the host bytes that backups of paused tags may hold (default: the device's memory)."""
        _check(lib.np_set_backup_limit(self.ctx, _uint(nbytes, "backup limit")))


def _tag(tag: object) -> bytes:
    if not isinstance(tag, str) or not tag:
        raise _invalid(f"a tag is a non-empty string, got {tag!r:.60}")
    if "\0" in tag:  # (C would read the name up to it: "a\0b" would be tag "a")
        raise _invalid(f"tag {tag!r:.60} holds a NUL character")
    try:
        return tag.encode("ascii")
    except UnicodeEncodeError:
        raise _invalid(f"tag {tag!r:.60} is not ASCII") from None


_REGIONS_LOCK = ForkSafeLock()  # a pool's open regions change whole: entered or left with its core region
_REGION_POOLS: "weakref.WeakSet[Pool]" = weakref.WeakSet()  # pools a region was entered on (the fork hook's)


def _leave_other_threads_regions() -> None:
    """In a forked child only the thread that forked runs: the regions other threads held open
    would never be left (every untagged request would go to them), so the child leaves them; the
    innermost region of the forking thread, if it is in one, is the pool's again."""
    me = threading.get_ident()
    for pool in list(_REGION_POOLS):
        with _REGIONS_LOCK:
            open_ = pool.__dict__.get("_regions") or []
            mine = [r for r in open_ if r.thread == me]
            if len(mine) == len(open_):
                continue
            try:
                ctx = pool.ctx
            except PoolError:  # closed: nothing to leave
                continue
            # (a real device's pool refuses every region call in a child, this one too: it stays as it was)
            if lib.np_region(ctx, mine[-1].tag if mine else ffi.NULL) == lib.NP_OK:
                pool.__dict__["_regions"] = mine


if hasattr(os, "register_at_fork"):  # (after _REGIONS_LOCK's own hook: the child's lock is a new one)
    os.register_at_fork(after_in_child=_leave_other_threads_regions)


class _Region:
    """The context manager of :meth:`Pool.region`: enters the tag; on exit leaves this region,
    and the innermost region still open becomes the pool's again (regions nest; a region left
    while one opened after it, by another thread, is still open leaves that one current).

    The region is the pool's, so that torch's backward threads allocate into it. So when a thread
    enters another tag while a region of another thread is open, every thread's requests go to
    the tag entered last, and a pause of it would take a tensor the other thread allocated: safe
    while that thread waits (an offload hook on torch's autograd thread), not while it allocates.
    A warning says so, once per pool."""

    def __init__(self, pool: Pool, tag: bytes):
        self.pool, self.tag, self.thread = pool, tag, 0

    def __enter__(self) -> "_Region":
        self.thread = threading.get_ident()  # (the thread that enters it, wherever it was made)
        with _REGIONS_LOCK:
            open_ = self.pool.__dict__.setdefault("_regions", [])
            other = next((r for r in open_ if r.thread != self.thread and r.tag != self.tag), None)
            _check(lib.np_region(self.pool.ctx, self.tag))
            open_.append(self)
            _REGION_POOLS.add(self.pool)
            warn = other is not None and not self.pool.__dict__.get("_warned_regions")
            if warn:
                self.pool.__dict__["_warned_regions"] = True
        if warn:
            import warnings

            warnings.warn(f"npu_pool: region {self.tag.decode()!r} entered while another thread holds region "
                          f"{other.tag.decode()!r} open on this pool: a region is the pool's, so that thread's "
                          f"requests go to {self.tag.decode()!r} too until this one is left (pausing it would take "
                          "them); enter regions from one thread unless the other waits meanwhile",
                          RuntimeWarning, stacklevel=2)
        return self

    def __exit__(self, *exc: object) -> None:
        with _REGIONS_LOCK:
            open_ = self.pool.__dict__.setdefault("_regions", [])
            for i in range(len(open_) - 1, -1, -1):  # this region, wherever it is (not whatever is on top)
                if open_[i] is self:
                    del open_[i]
                    break
            try:
                ctx = self.pool.ctx
            except PoolError:  # closed meanwhile (by another thread): nothing to leave, and the
                return  # body's own exception, if any, is the one to see
            rc = lib.np_region(ctx, open_[-1].tag if open_ else ffi.NULL)
            if rc != lib.NP_OK and not self.pool._closed:  # (a close racing with this call: as above)
                _raise(rc)
