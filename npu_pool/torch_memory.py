"""torch's memory APIs answered by the installed pool, on CUDA and on Ascend NPUs.

torch's ``CUDAPluggableAllocator`` has no device-statistics hook (``torch.cuda.memory_stats()``
raises), and torch_npu's ``NPUPluggableAllocator`` answers snapshots, memory history and
accumulated-statistics resets with a warning or nothing. Once npu_pool is installed, the
functions of torch's C module that those Python APIs call are answered from the pool:

=======================================  ========================================  =============================
torch (``torch._C``)                     torch_npu (``torch_npu._C``)              answered by
=======================================  ========================================  =============================
``_cuda_memoryStats``                    ``_npu_memoryStats`` (without C++ hooks)  :func:`stats_dict`
``_cuda_resetPeakMemoryStats``           ``_npu_resetPeakMemoryStats``             ``Pool.reset_peak``
``_cuda_resetAccumulatedMemoryStats``    ``_npu_resetAccumulatedMemoryStats``      ``Pool.reset_accumulated``
``_cuda_memorySnapshot``                 ``_npu_memorySnapshot``                   ``npu_pool.snapshot``
``_cuda_record_memory_history``          ``_npu_record_memory_history``            the pools' history bound
``_cuda_record_memory_history_legacy``                                             the same (``enabled`` a bool)
``_cuda_attach_out_of_memory_observer``  ``_npu_attach_out_of_memory_observer``    :func:`notify_oom`
``_cuda_getMemoryFraction``              ``_npu_getMemoryFraction``                ``stats()['fraction']``
=======================================  ========================================  =============================

So ``memory_stats``, ``memory_allocated``, ``max_memory_allocated``, ``memory_reserved``,
``max_memory_reserved``, ``reset_peak_memory_stats``, ``reset_accumulated_memory_stats``,
``memory_summary``, ``memory_snapshot``, ``_record_memory_history``, ``_snapshot``,
``_dump_snapshot`` and ``get_per_process_memory_fraction`` (``torch.cuda.*`` and ``torch.npu.*``)
give the pool's exact figures, and out-of-memory observers are called (a device
torch does not have raises "Invalid device argument", as torch's own allocators do); with
torch_npu's C++ hooks (``npu_pool.cpp_hooks``) ``memory_stats`` comes from C++, the same mapping.
torch_npu's Python ``_record_memory_history`` passes the older form to a function that takes only
the newer one (a TypeError, npu_pool or not): ``torch_npu.npu.memory._record_memory_history_impl``
takes both. ``mem_get_info`` asks the device itself and needs nothing. Snapshots carry no Python frames
(the pool records no stacks): memory_viz shows each block with its size, stream and time.

Graph capture and private memory pools are refused (:class:`PrivatePoolError`): the pluggable
allocators pass ``beginAllocateToPool`` to a hook where one is set and do nothing without one, and
npu_pool has no private pools to keep a graph's memory apart, so a captured graph's memory went
back to the pool and was handed to other tensors while the graph replayed (measured on an H100:
docs/gpu.md). The graph classes' ``capture_begin`` (and
their C base classes'), the ``graph`` context managers and the ``*beginAllocate*ToPool`` entry
points, wherever torch binds them (``use_mem_pool``), raise it instead. So does a second swap
(``change_current_allocator``, which MindSpeed's ``--smart-swap`` calls): :class:`AllocatorInUseError`,
naming npu_pool, where torch's own refusal named neither.
"""
from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, NamedTuple, Optional

from . import snapshot
from ._core import lib
from .pool import _check
from .vocab import HISTORY_DEFAULT, HISTORY_MAX

__all__ = ["stats_dict", "snapshot_of_installed", "route", "notify_oom", "PrivatePoolError", "AllocatorInUseError"]

_STAT_ARRAYS = {"allocation": "blocks", "segment": "segments", "active": "blocks", "allocated_bytes": "allocated",
                "reserved_bytes": "reserved", "active_bytes": "active", "requested_bytes": "requested"}
_ZERO = {"current": 0, "peak": 0, "allocated": 0, "freed": 0}


def _stat(counter: dict[str, int]) -> dict[str, int]:
    return {k: int(counter[k]) for k in ("current", "peak", "allocated", "freed")}


def stats_dict(pool: Any) -> dict[str, Any]:
    """``pool.stats()`` in the layout of ``torch.cuda.memory_stats_as_nested_dict()``: the totals
    under ``all``; ``small_pool``/``large_pool`` where the policy's pools are those (torch,
    expandable), zeros otherwise; ``inactive_split_bytes`` is the free memory the pool holds
    (reserved, not active) that ``empty_cache`` could not return (``stats()["releasable"]`` is
    what it could): torch's "non-releasable memory"."""
    st = pool.stats()
    pools = st["pools"]
    small_large = list(pools) == ["small", "large"]
    out: dict[str, Any] = {}
    for key, field in _STAT_ARRAYS.items():
        out[key] = {"all": _stat(st["total"][field]),
                    "small_pool": _stat(pools["small"][field]) if small_large else dict(_ZERO),
                    "large_pool": _stat(pools["large"][field]) if small_large else dict(_ZERO)}
    free = int(st["non_releasable"])
    out["inactive_split_bytes"] = {"all": dict(_ZERO, current=free, peak=free), "small_pool": dict(_ZERO),
                                   "large_pool": dict(_ZERO)}
    out["inactive_split"] = {"all": dict(_ZERO), "small_pool": dict(_ZERO), "large_pool": dict(_ZERO)}
    out["oversize_allocations"] = dict(_ZERO)
    out["oversize_segments"] = dict(_ZERO)
    out.update(num_alloc_retries=int(st["retries"]), num_ooms=int(st["ooms"]), max_split_size=-1,  # (torch's unset)
               num_sync_all_streams=int(st["syncs"]), num_device_alloc=int(st["device_mallocs"]),
               num_device_free=int(st["device_frees"]), num_oom_rejections=0)
    return out


_installed: Callable[[], dict[int, Any]] = dict  # the installation's pools; route() sets it


def _pools() -> dict[int, Any]:
    return _installed()


def _existing() -> dict[int, Any]:
    """The installed pools whose device has served memory (a context exists)."""
    return {d: p for d, p in _pools().items() if p.serving}


def _pool(device: Optional[int]) -> Any:
    """The pool of ``device``; RuntimeError "Invalid device argument" (torch's own allocators'
    words) for a device torch does not have."""
    pools = _pools()
    d = 0 if device is None else int(device)
    if d not in pools:
        raise RuntimeError(f"Invalid device argument {d}: did you call init? (npu_pool serves devices "
                           f"{', '.join(map(str, sorted(pools))) or 'none'})")
    return pools[d]


def snapshot_of_installed(*_args: Any, **_kwargs: Any) -> dict[str, Any]:
    """A PyTorch snapshot of every device the installed pool serves (``_snapshot()``)."""
    return snapshot.pool_snapshot(_existing(), devices=len(_pools()))


def _memory_stats(device: Optional[int] = None) -> dict[str, Any]:
    return stats_dict(_pool(device))


def _reset_peak(device: Optional[int] = None) -> None:
    _pool(device).reset_peak()


def _reset_accumulated(device: Optional[int] = None) -> None:
    _pool(device).reset_accumulated()


def _record_history(enabled: Any = "all", context: Any = None, stacks: Any = None, max_entries: Any = sys.maxsize,
                    *args: Any, **kwargs: Any) -> None:
    """``_record_memory_history``: from now on keep ``max_entries`` events on every device
    (``enabled=None``/False: back to the default bound). Clears what was kept, as torch does.
    While OOM snapshots are on, no fewer than they keep (a profiler stopping cut them to the
    default, ``max_entries=0`` to none, and a snapshot said written held no event)."""
    from .oom import HISTORY_WHEN_ENABLED, snapshot_dir

    on = enabled not in (None, False)
    try:
        n = int(max_entries) if on else HISTORY_DEFAULT
    except (TypeError, ValueError):
        raise ValueError(f"max_entries must be a number of events, got {max_entries!r}") from None
    if n < 0:
        raise ValueError(f"max_entries must be >= 0, got {n}")
    if snapshot_dir():
        n = max(n, HISTORY_WHEN_ENABLED)
    _check(lib.npu_pool_set_history(-1, min(n, HISTORY_MAX)))  # "unlimited" asks for sys.maxsize


def _memory_fraction(device: Optional[int] = None) -> float:
    """``get_per_process_memory_fraction``: the fraction capping the device (1.0: none), the one
    set before its first request included (the pluggable allocators raised "does not yet
    support getMemoryFraction")."""
    return float(_pool(device).stats()["fraction"])


def _record_history_legacy(enabled: Any, record_context: Any = True, trace_alloc_max_entries: Any = 1,
                           *args: Any, **kwargs: Any) -> None:
    """torch's older form, ``_record_memory_history(True, trace_alloc_max_entries=N, ...)``
    (MindSpeed's and Megatron's ``--record-memory-history``): ``enabled`` a bool, the bound
    ``trace_alloc_max_entries``. The pluggable allocator raised "does not yet support
    recordHistory" for it."""
    _record_history("all" if enabled else None, max_entries=trace_alloc_max_entries)


def _record_history_any(enabled: Any = "all", *args: Any, **kwargs: Any) -> None:
    """torch_npu's Python ``_record_memory_history`` hands both forms to its ``_impl``, which takes
    only the newer one: the older ``(True, trace_alloc_max_entries=N)`` (MindSpeed's
    ``--record-memory-history``) raised TypeError there. Told apart as torch's own wrapper does:
    ``enabled`` a bool is the older form."""
    if isinstance(enabled, bool):
        _record_history_legacy(enabled, *args, **kwargs)
    else:
        _record_history(enabled, *args, **kwargs)


_observers: list[Callable[[int, int, int, int], Any]] = []  # torch's out-of-memory observers


def _attach_oom_observer(observer: Callable[[int, int, int, int], Any]) -> None:
    """``torch._C._cuda_attach_out_of_memory_observer`` (and torch_npu's): ``observer(device,
    request, cap, device_free)`` after each request the pool could not serve, as torch's
    allocator calls it (the pluggable allocator raised "does not yet support" for it)."""
    if not callable(observer):
        raise TypeError(f"an out-of-memory observer is a callable, got {observer!r:.60}")
    _observers.append(observer)


def notify_oom(pool: Any, device: int, size: int) -> None:
    """Call the attached out-of-memory observers for a request of ``size`` bytes ``pool`` (of
    ``device``) could not serve; one that raises is reported on stderr and the rest still run
    (the failing request raises either way)."""
    if not _observers:
        return
    st = pool.stats()
    last = next((e for e in reversed(pool.history(limit=8)) if e["kind"] == "oom"), None)
    free = last["device_free"] if last is not None else (1 << 64) - 1
    if free == (1 << 64) - 1:  # (no such event kept, or the device did not say: what the pool leaves it)
        free = max(st["device_total"] - st["total"]["reserved"]["current"], 0)
    for observer in list(_observers):
        try:
            observer(device, size, st["limit"], free)
        except Exception as e:  # (it runs inside the failing malloc: nothing may escape there)
            print(f"npu_pool: an out-of-memory observer raised {e!r:.200}", file=sys.stderr)


# kind -> {name in torch's C module: replacement}; stats only where no C++ hook answers them
_ROUTES: dict[str, dict[str, Callable[..., Any]]] = {
    "cuda": {"_cuda_memoryStats": _memory_stats, "_cuda_resetPeakMemoryStats": _reset_peak,
             "_cuda_resetAccumulatedMemoryStats": _reset_accumulated, "_cuda_memorySnapshot": snapshot_of_installed,
             "_cuda_record_memory_history": _record_history,
             "_cuda_record_memory_history_legacy": _record_history_legacy,
             "_cuda_attach_out_of_memory_observer": _attach_oom_observer,
             "_cuda_getMemoryFraction": _memory_fraction},
    "npu": {"_npu_resetAccumulatedMemoryStats": _reset_accumulated, "_npu_memorySnapshot": snapshot_of_installed,
            "_npu_record_memory_history": _record_history,
            "_npu_attach_out_of_memory_observer": _attach_oom_observer,
            "_npu_getMemoryFraction": _memory_fraction,
            "_npu_resetPeakMemoryStats": _reset_peak},  # the C hook cannot refuse a device torch lacks
}
_NPU_STATS = {"_npu_memoryStats": _memory_stats}
# kind -> (Python module, {name: replacement}): where a framework's Python layer fails before it reaches its C module
_PYTHON_ROUTES: dict[str, tuple[str, dict[str, Callable[..., Any]]]] = {
    "npu": ("torch_npu.npu.memory", {"_record_memory_history_impl": _record_history_any}),
}


class PrivatePoolError(RuntimeError):
    """Graph capture or a private memory pool was asked of the installed npu_pool."""


class AllocatorInUseError(RuntimeError):
    """Another allocator was asked to replace the installed npu_pool (change_current_allocator)."""


# where each framework swaps its allocator (a module attribute, as callers reach it)
_SWAPS = {"cuda": "torch.cuda.memory", "npu": "torch_npu.npu.memory"}


def _swap_refuser(kind: str) -> Callable[..., Any]:
    message = (f"npu_pool is torch's {kind.upper()} allocator here (MEMORY_FRAGMENTATION=1, or npu_pool.install()), "
               f"and {_SWAPS[kind]}.change_current_allocator() asks for another: torch swaps an allocator only "
               "before its first use, and npu_pool already serves this process's tensors. Use one of the two: "
               "unset MEMORY_FRAGMENTATION (no npu_pool.install()), or drop what brings the other allocator "
               "(MindSpeed's --smart-swap does).")

    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise AllocatorInUseError(message)
    return refuse


class _Pools(NamedTuple):
    """Where a framework begins graph capture and private pools."""

    entries: tuple[str, ...]     # the C module's pool entry points
    modules: tuple[str, ...]     # Python modules that bind those names themselves (from ... import)
    graphs: str                  # the graphs module
    graph_class: str             # its graph class (capture_begin), whose C base class is base_class
    base_class: str              # in the C module
    compiled: str                # how a compiled model captures
    uncaptured: str              # how it runs without capture


_POOLS = {
    "cuda": _Pools(("_cuda_beginAllocateToPool", "_cuda_beginAllocateCurrentThreadToPool"), ("torch.cuda.memory",),
                   "torch.cuda.graphs", "CUDAGraph", "_CUDAGraph", 'torch.compile(mode="reduce-overhead"), ',
                   ' (torch.compile: mode="max-autotune-no-cudagraphs" captures nothing)'),
    "npu": _Pools(("_npu_beginAllocateToPool", "_npu_beginAllocateCurrentStreamToPool",
                   "_npu_beginAllocateCurrentThreadToPool"), ("torch_npu.npu.memory",),
                  "torch_npu.npu.graphs", "NPUGraph", "_NPUGraph", "torchair's aclgraph mode, ", ""),
}


def _refuser(kind: str) -> Callable[..., Any]:
    at = _POOLS[kind]
    message = (f"npu_pool: graph capture and private memory pools (torch.{kind}.graph, {at.graph_class}.capture_begin, "
               f"{at.compiled}MemPool) are not supported while npu_pool is torch's allocator: the memory a "
               "captured graph uses would go back to the pool and be handed to other tensors while the graph "
               "replays, silently overwriting them. Run the captured part without npu_pool (unset "
               f"MEMORY_FRAGMENTATION, no npu_pool.install()) or uncaptured{at.uncaptured}.")

    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise PrivatePoolError(message)
    return refuse


_MISSING = object()


def _module(name: str) -> Any:
    """The module ``name``, or None where the framework has none."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def route(kind: str, torch: Any, pools: Callable[[], dict[int, Any]], *, stats_from_python: bool
          ) -> Callable[[], None]:
    """Point torch's memory APIs at the installed pools (``pools()``: ``{device: Pool}``);
    returns a function that puts the originals back (for tests: torch keeps using the pool's
    memory either way).

    ``kind`` "cuda" patches ``torch._C``, "npu" patches ``torch_npu._C``;
    ``stats_from_python``: on an NPU also the statistics (no C++ hook answers them). Graph
    capture and private pools are refused (:class:`PrivatePoolError`)."""
    global _installed
    _installed = pools
    target = torch._C if kind == "cuda" else sys.modules["torch_npu"]._C
    table = dict(_ROUTES[kind])
    if kind == "npu" and stats_from_python:
        table.update(_NPU_STATS)
    at, refuse = _POOLS[kind], _refuser(kind)
    table.update({name: refuse for name in at.entries if hasattr(target, name)})
    patched = [(target, name, fn) for name, fn in table.items()]
    if kind in _PYTHON_ROUTES:
        module_name, functions = _PYTHON_ROUTES[kind]
        module = _module(module_name)
        patched += [(module, name, fn) for name, fn in functions.items() if hasattr(module, name)]
    swaps = _module(_SWAPS[kind])
    if hasattr(swaps, "change_current_allocator"):  # a second swap: torch's own refusal names no npu_pool
        patched.append((swaps, "change_current_allocator", _swap_refuser(kind)))
    graphs = _module(at.graphs)
    for module in map(_module, at.modules):  # (their own binding of an entry point, where they made one)
        patched += [(module, name, refuse) for name in at.entries
                    if getattr(module, name, _MISSING) is getattr(target, name, None)]
    for cls, name in ((getattr(graphs, at.graph_class, None), "capture_begin"), (getattr(graphs, "graph", None), "__init__"),
                      (getattr(target, at.base_class, None), "capture_begin")):  # (super().capture_begin)
        if isinstance(cls, type) and hasattr(cls, name):
            patched.append((cls, name, refuse))
    saved = []
    for obj, name, fn in patched:
        # (a class's own attribute: restoring an inherited one would shadow its base's)
        old = obj.__dict__.get(name, _MISSING) if isinstance(obj, type) else getattr(obj, name, _MISSING)
        try:
            setattr(obj, name, fn)  # (pybind11's classes take attributes too)
        except (TypeError, AttributeError):  # (a C class that does not: the Python paths above it still refuse)
            continue
        saved.append((obj, name, old))

    def restore() -> None:
        _observers.clear()
        for obj, name, old in saved:
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)

    return restore
