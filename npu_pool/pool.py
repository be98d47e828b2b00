"""The Python face of the C core: ``Pool`` (one allocator context) and errors."""
from __future__ import annotations

from typing import Any, Union

from ._core import ffi, lib

POLICIES: dict[str, int] = {ffi.string(lib.np_policy_name(i)).decode(): i for i in range(lib.np_policy_count())}
BACKENDS: dict[str, int] = {"sim": lib.NP_BACKEND_SIM, "acl": lib.NP_BACKEND_ACL, "cuda": lib.NP_BACKEND_CUDA}
LIFETIMES: dict[str, int] = {"auto": lib.NP_LIFE_AUTO, "long": lib.NP_LIFE_LONG, "short": lib.NP_LIFE_SHORT}
POOL_NAMES: dict[str, tuple[str, ...]] = {
    name: tuple(ffi.string(lib.np_policy_pool_name(i, p)).decode() for p in range(lib.NP_POOLS))
    for name, i in POLICIES.items()}
GiB = 1 << 30


class PoolError(RuntimeError):
    """An allocator call failed; ``code`` is the core's NP_ERR_* value."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class OutOfMemoryError(PoolError, MemoryError):
    """The device, or the fraction cap, has no room for the request."""


class InvalidArgumentError(PoolError, ValueError):
    """A bad argument: size 0, absurd size, bad fraction, unknown name."""


class DoubleFreeError(PoolError):
    """The pointer was allocated by this pool and already freed."""


class UnknownPointerError(PoolError):
    """The pointer was never handed out by this pool."""


_ERRORS: dict[int, type[PoolError]] = {lib.NP_ERR_OOM: OutOfMemoryError, lib.NP_ERR_DOUBLE_FREE: DoubleFreeError,
                                       lib.NP_ERR_UNKNOWN_PTR: UnknownPointerError,
                                       lib.NP_ERR_INVALID: InvalidArgumentError}


def _raise(code: int) -> None:
    message = ffi.string(lib.np_last_error()).decode(errors="replace")
    raise _ERRORS.get(code, PoolError)(code, message)


def _check(code: int) -> None:
    if code != lib.NP_OK:
        _raise(code)


def _lookup(table: dict[str, int], value: str, what: str) -> int:
    try:
        return table[value]
    except (KeyError, TypeError):
        raise InvalidArgumentError(lib.NP_ERR_INVALID,
                                   f"unknown {what} {value!r}; choose one of {', '.join(table)}") from None


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


class Pool:
    """One allocator context over one (simulated or real) device.

    ``policy``: ``"npu_pool"`` (one arena, lifetime-aware placement), ``"torch"`` (a model
    of PyTorch's caching allocator) or ``"expandable"`` (PyTorch's expandable segments).
    ``capacity`` is the simulated device's memory; ``host_backed`` puts real host memory
    behind it; ``vmm`` lets the arena grow page by page where the backend can map pages.
    """

    def __init__(self, policy: str = "npu_pool", capacity: int = 64 * GiB, backend: str = "sim", *,
                 host_backed: bool = False, vmm: bool = True, fraction: float = 1.0,
                 max_split_size: int | None = None, device: int = 0, lib_path: str | None = None):
        cfg = ffi.new("np_config *")
        lib.np_config_init(cfg)
        cfg.policy = _lookup(POLICIES, policy, "policy")
        cfg.backend = _lookup(BACKENDS, backend, "backend")
        if not isinstance(capacity, int) or capacity <= 0:
            raise InvalidArgumentError(lib.NP_ERR_INVALID, f"capacity must be a positive number of bytes, got {capacity!r}")
        cfg.capacity = capacity
        cfg.host_backed = bool(host_backed)
        cfg.vmm = bool(vmm)
        cfg.fraction = float(fraction)
        cfg.max_split_size = max_split_size or 0
        cfg.device = device
        path = ffi.new("char[]", lib_path.encode()) if lib_path else ffi.NULL
        cfg.lib_path = path
        out = ffi.new("np_ctx **")
        _check(lib.np_create(cfg, out))
        self._ctx = out[0]
        self.policy = policy
        self.backend = backend

    # -- lifetime -----------------------------------------------------------------------
    def close(self) -> None:
        """Return all device memory and destroy the context (pointers become invalid)."""
        if getattr(self, "_ctx", None) is not None:
            ctx, self._ctx = self._ctx, None
            _check(lib.np_destroy(ctx))

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except PoolError:
            pass

    @property
    def ctx(self) -> Any:
        if self._ctx is None:
            raise PoolError(lib.NP_ERR_STATE, "pool is closed")
        return self._ctx

    # -- allocation ---------------------------------------------------------------------
    def malloc(self, size: int, stream: int = 0, lifetime: str = "auto", site: int = -1) -> int:
        """Allocate ``size`` bytes on ``stream``; returns the device address."""
        if not isinstance(size, int) or size < 0:
            raise InvalidArgumentError(lib.NP_ERR_INVALID, f"size must be a non-negative int, got {size!r}")
        out = ffi.new("void **")
        life = _lookup(LIFETIMES, lifetime, "lifetime")
        try:
            _check(lib.np_malloc_ex(self.ctx, size, stream, life, site, out))
        except OutOfMemoryError as e:  # NPU_POOL_OOM_SNAPSHOT: write a snapshot, explain the failure
            from .analysis.oom import on_oom

            note = on_oom(self, size, e)
            if note:
                e.args = (f"{e.args[0]}\n{note}",)
            raise
        return int(ffi.cast("uintptr_t", out[0]))

    def free(self, ptr: int) -> None:
        """Free an address returned by :meth:`malloc`."""
        _check(lib.np_free(self.ctx, ffi.cast("void *", ptr)))

    def record_stream(self, ptr: int, stream: int) -> None:
        """torch's ``record_stream``: the block is also used on ``stream``; its memory is not
        reused before that use ends."""
        _check(lib.np_record_stream(self.ctx, ffi.cast("void *", ptr), stream))

    def block_size(self, ptr: int) -> int:
        """Bytes of the block behind an allocated address (requested size rounded)."""
        out = ffi.new("uint64_t *")
        _check(lib.np_block_size(self.ctx, ffi.cast("void *", ptr), out))
        return int(out[0])

    def empty_cache(self) -> None:
        """Return every cached byte the policy can give back to the device."""
        _check(lib.np_empty_cache(self.ctx))

    def set_fraction(self, fraction: float) -> None:
        """Cap reserved bytes at ``fraction`` x device memory (0 < fraction <= 1)."""
        _check(lib.np_set_fraction(self.ctx, float(fraction)))

    # -- hints ----------------------------------------------------------------------------
    def set_phase(self, phase: int, default_lifetime: str = "auto") -> None:
        """Set the phase counter and the class of requests whose site has no history."""
        _check(lib.np_set_phase(self.ctx, phase, _lookup(LIFETIMES, default_lifetime, "lifetime")))

    def mark(self, code: Union[int, str], arg: int = -1) -> None:
        """Record a phase marker (a ``MARK_*`` code or its name, e.g. ``"setup_begin"``)."""
        if isinstance(code, str):
            from .trace.format import MARK_NAMES

            code = _lookup({n: i for i, n in enumerate(MARK_NAMES)}, code, "marker")
        _check(lib.np_mark(self.ctx, code, arg))

    # -- introspection --------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters of the whole device and of each pool (see docs/api.md)."""
        st = ffi.new("np_stats *")
        lib.np_get_stats(self.ctx, st)
        d = _as_dict(st[0])
        d["pools"] = {p.pop("name"): p for p in d.pop("pool")}
        d["total"].pop("name")
        d["policy"] = self.policy
        d["vmm"] = bool(d["vmm"])
        return d

    def blocks(self) -> list[dict[str, Any]]:
        """Every block of every segment, in address order (segment map for reports)."""
        n = ffi.new("size_t *")
        _check(lib.np_blocks(self.ctx, ffi.NULL, 0, n))
        while True:
            cap = n[0]
            buf = ffi.new("np_block_info[]", max(cap, 1))
            _check(lib.np_blocks(self.ctx, buf, cap, n))
            if n[0] <= cap:
                return [_as_dict(buf[i]) for i in range(n[0])]

    def recent_events(self, limit: int = 4096) -> list[dict[str, Any]]:
        """The most recent allocator events (alloc, free, segment_*, empty_cache, oom, mark), oldest first."""
        buf = ffi.new("np_event_info[]", max(limit, 1))
        n = ffi.new("size_t *")
        _check(lib.np_history(self.ctx, buf, limit, n))
        return [dict(_as_dict(buf[i]), kind=ffi.string(lib.np_vocab_name(lib.NP_VOCAB_EVENT, buf[i].kind)).decode())
                for i in range(n[0])]

    def load_plan(self, plan: Any) -> None:
        """Install an allocation plan (a ``npu_pool.planner.Plan`` or a plan file) on a ``"planned"`` pool."""
        from .planner.runtime import install

        install(self, plan)

    def reset_peak(self) -> None:
        """Reset every peak to the current value."""
        lib.np_reset_peak(self.ctx)

    def check(self) -> None:
        """Verify the core's invariants; raises PoolError naming the first violation."""
        _check(lib.np_check(self.ctx))


_installed: dict[int, Pool] = {}


def set_fraction(fraction: float, device: int | None = None) -> None:
    """Cap the installed device allocator at ``fraction`` of the device's memory."""
    if not _installed:
        raise PoolError(lib.NP_ERR_STATE, "no npu_pool allocator is installed: call npu_pool.install() first, "
                        "or use Pool.set_fraction() on a pool you created")
    pools = _installed.values() if device is None else [_installed[device]] if device in _installed else []
    if not pools:
        raise ValueError(f"no npu_pool allocator installed on device {device}; installed: {sorted(_installed)}")
    for p in pools:
        p.set_fraction(fraction)
