"""``npu_pool.install()``: make npu_pool torch's device allocator.

Builds torch_npu's ``NPUPluggableAllocator`` or torch's ``CUDAPluggableAllocator`` over the
core's shared object (the C entry points of ``csrc/pluggable.h``), registers the hooks whose
signatures match what torch calls, swaps it in, and routes torch's memory APIs
(``memory_stats``, ``memory_allocated``, ``reset_peak_memory_stats``, ``memory_summary``,
``_record_memory_history``, ``_snapshot``, ...) to the pool (``npu_pool.torch_memory``). On
an NPU, the hooks that take C++ types (device statistics, ``record_stream``) and, on both, the
malloc that raises ``torch.OutOfMemoryError`` come from a small C++ library built against the
installed torch (``npu_pool.cpp_hooks``). It must run before torch allocates device memory:
``MEMORY_FRAGMENTATION=1`` in the environment does that in every process (the package's
start-up hook), or call ``npu_pool.install()`` at the top of the training script.
"""
from __future__ import annotations

import importlib.util
import operator
import os
import sys
import types
import warnings
from typing import Any, Optional

from . import config, oom
from .locks import ForkSafeLock
from ._core import ffi, lib
from .pool import (BACKENDS, PLAN_COUNTS, POLICIES, Pool, PoolError, PoolView, UnknownPointerError, _check, _fraction,
                   _invalid, _flag, _lib_path, _tag, _uint)

__all__ = ["install", "installed", "current_pool", "set_fraction", "set_compaction", "InstallError",
           "DeviceUnavailableError", "TooLateError", "last_error", "core_path"]

# (setter on torch's allocator object, C entry point). Checked against torch 2.13's
# torch/csrc/cuda/CUDAPluggableAllocator.h and torch_npu 2.13's NPUPluggableAllocator.h:
#   set_init_fn              void(int device_count)              both
#   set_reset_fn             void()                              CUDA (torch.cuda.empty_cache)
#   set_reset_fn             void(bool check_error)              torch_npu (torch.npu.empty_cache)
#   set_memory_fraction_fn   void(double fraction, int device)   both
#   set_reset_peak_status_fn void(c10::DeviceIndex)              torch_npu only
#   set_record_stream_fn     void(void* ptr, cudaStream_t)       CUDA
# torch_npu's set_get_device_stats_fn, set_record_stream_fn and set_erase_stream_fn take C++ types:
# they come from cpp_hooks. Not registered: set_base_alloc_fn (IPC; virtual-memory pages cannot be
# shared that way) and the graph-pool hooks (std::function / MempoolId_t arguments).
_HOOKS: dict[str, tuple[tuple[str, str], ...]] = {
    "cuda": (("set_init_fn", "npu_pool_init"), ("set_reset_fn", "npu_pool_empty_cache"),
             ("set_memory_fraction_fn", "npu_pool_memory_fraction"),
             ("set_record_stream_fn", "npu_pool_record_stream")),
    "npu": (("set_init_fn", "npu_pool_init"), ("set_reset_fn", "npu_pool_empty_cache_checked"),
            ("set_memory_fraction_fn", "npu_pool_memory_fraction"),
            ("set_reset_peak_status_fn", "npu_pool_reset_peak")),
}
_BACKEND_OF = {"cuda": "cuda", "npu": "acl"}


class InstallError(RuntimeError):
    """npu_pool could not be installed as torch's device allocator."""


class DeviceUnavailableError(InstallError):
    """Neither an Ascend NPU (torch_npu) nor a CUDA GPU is usable."""


class TooLateError(InstallError):
    """torch already initialised its own device allocator."""


class _Installation:
    """What install() did: the device kind, settings, torch's allocator object and the pools."""

    def __init__(self, kind: str, module: Any, policy: str, backend: str, fraction: Optional[float],
                 allocator: Any, hooks: list[str], cpp_hooks: bool):
        self.kind, self.module, self.policy, self.backend = kind, module, policy, backend
        self.fraction, self.allocator, self.hooks, self.cpp_hooks = fraction, allocator, hooks, cpp_hooks
        self.pools: dict[int, "_DevicePool"] = {}
        self.plan_used: list[bool] = []  # per device: the plan was installed (not found worse than online)
        self.unroute: Any = None  # puts torch's memory APIs back (torch_memory.route)
        self.lib_path: Optional[str] = None  # the vendor library the caller named (None: the default)


_current: Optional[_Installation] = None
_lock = ForkSafeLock()
_fractions = ForkSafeLock()  # one set_fraction over the devices at a time


def core_path() -> str:
    """Path of the core's shared object, which exports the allocator entry points."""
    from . import _core

    return _core.__file__


def _address(symbol: str) -> int:
    """Address of one of the core's C entry points, as torch's setters take it."""
    return int(ffi.cast("uintptr_t", ffi.addressof(lib, symbol)))


_ERROR_TEXT = 8192  # the longest message the core keeps (csrc/common.h NP_ERR_TEXT)


def last_error(device: int = -1) -> str:
    """The last failure the allocator hooks met on ``device`` (also printed to stderr);
    ``device=-1``: the calling thread's last core error."""
    buf = ffi.new("char[]", _ERROR_TEXT)
    lib.npu_pool_last_error(device, buf, _ERROR_TEXT)
    return ffi.string(buf).decode(errors="replace")


class _DevicePool(Pool):
    """The installed allocator's context on one device. The context belongs to the shared
    object's device table: it is created on first use and never closed or freed here."""

    _owns = False

    def __init__(self, device: int, policy: str, backend: str):  # no Pool.__init__: nothing to create
        self._ctx = None
        self.device = device
        self.policy = policy
        self.backend = backend

    @property
    def ctx(self) -> Any:
        if self._ctx is None:
            ctx = lib.npu_pool_device_ctx(self.device)
            if ctx == ffi.NULL:
                _check(lib.NP_ERR_BACKEND)
            self._ctx = ctx
        return self._ctx

    @property
    def serving(self) -> bool:
        """Whether the device has a context yet (it is made at the first allocation)."""
        return lib.npu_pool_existing_ctx(self.device) != ffi.NULL

    def _read_stats(self, st: Any) -> None:  # zeros before the first allocation, without making a context
        _check(lib.npu_pool_device_stats(self.device, st))

    def reset_peak(self) -> None:
        if self.serving:
            super().reset_peak()

    def reset_accumulated(self) -> None:
        lib.npu_pool_reset_accumulated(self.device)

    def set_fraction(self, fraction: float) -> None:
        """Cap this device at ``fraction`` of its memory (applied when its context exists)."""
        _check(lib.npu_pool_set_fraction(self.device, _fraction(fraction)))

    def set_compaction(self, on: bool) -> None:
        """Compaction on this device (:meth:`Pool.set_compaction`; applied when its context exists)."""
        _check(lib.npu_pool_set_compaction(self.device, _flag(on, "compaction")))

    # A device that served nothing has no context, and nothing to show: reading it makes none (on a
    # device, a context on every device of every rank).
    def blocks(self) -> list[dict[str, Any]]:
        return super().blocks() if self.serving else []

    def mapped_ranges(self) -> list[tuple[int, int]]:
        return super().mapped_ranges() if self.serving else []

    def history(self, limit: Optional[int] = None) -> list[dict[str, Any]]:
        return super().history(limit) if self.serving else []

    def view(self, history_limit: Optional[int] = None) -> PoolView:
        return super().view(history_limit) if self.serving else PoolView(self.stats(), [], [], [])

    def tags(self) -> dict[str, dict[str, Any]]:
        return super().tags() if self.serving else {}

    def check(self) -> None:
        if self.serving:
            super().check()

    def empty_cache(self) -> None:
        if self.serving:
            super().empty_cache()

    def forget(self) -> None:
        if self.serving:
            super().forget()

    def compact(self) -> int:
        return super().compact() if self.serving else 0

    def set_history(self, max_entries: int) -> None:
        _check(lib.npu_pool_set_history(self.device, _uint(max_entries, "max_entries")))

    def block_size(self, ptr: int) -> int:
        if not self.serving:  # (the core's refusal, without making a context to hear it)
            raise UnknownPointerError(lib.NP_ERR_UNKNOWN_PTR, f"{_uint(ptr, 'pointer'):#x} on device {self.device}: "
                                      "this pool never allocated it (the device has served nothing)")
        return super().block_size(ptr)

    def pause(self, tag: str, backup: bool = False) -> int:
        if not self.serving:
            _flag(backup, "backup")
            raise self._no_tag("pause", tag)
        return super().pause(tag, backup)

    def resume(self, tag: str) -> int:
        if not self.serving:
            raise self._no_tag("resume", tag)
        return super().resume(tag)

    def _no_tag(self, what: str, tag: object) -> PoolError:
        _tag(tag)  # (a bad name is that first)
        if self.policy != "npu_pool":
            return PoolError(lib.NP_ERR_STATE, f"policy {self.policy} has no tagged regions: region, pause and "
                                               "resume need policy npu_pool")
        return _invalid(f"{what}: no tag {tag!r:.60} (tags: none yet: device {self.device} has served nothing); "
                        "tensors get a tag when allocated inside npu_pool.region(tag)")

    def plan_counts(self) -> dict[str, int]:
        if self.serving:
            return super().plan_counts()
        if self.policy != "planned":  # (the core's refusal, without making a context to hear it)
            raise PoolError(lib.NP_ERR_STATE, f"np_set_plan: the pool's policy is {self.policy}, not planned")
        return dict.fromkeys(PLAN_COUNTS, 0)

    def close(self) -> None:
        self._ctx = None


def installed() -> dict[int, Pool]:
    """The installed allocator's pools, ``{device: Pool}`` (empty before :func:`install`)."""
    return dict(_current.pools) if _current else {}


def current_pool(start: bool = True) -> Optional[Pool]:
    """The installed allocator's pool of torch's current device (None before :func:`install`,
    or when the current device cannot be asked). ``start=False``: None too while torch has not
    started the device in this process (asking starts it: torch_npu's ``current_device()``
    initialises the runtime), so that a process that never used it (a launcher, a DataLoader
    worker) is left without a device context."""
    inst = _current
    if inst is None:
        return None
    try:
        if not start and not inst.module.is_initialized():
            return None
        device = inst.module.current_device()
    except Exception:  # no device context yet (torch_npu before set_device, a broken runtime)
        return None
    return inst.pools.get(device)


def set_fraction(fraction: float, device: Optional[int] = None) -> None:
    """Cap the installed device allocator at ``fraction`` of the device's memory (every device,
    or ``device``)."""
    _set_fractions(_chosen(device, "Pool.set_fraction()"), fraction)


def _chosen(device: Optional[int], instead: str) -> list[Any]:
    """The installed device pools a setter applies to: every one, or ``device``'s."""
    if device is not None:
        try:
            device = operator.index(device) if not isinstance(device, bool) else None
        except TypeError:
            device = None
        if device is None:
            raise _invalid("device must be a device index (an int) or None")
    pools = installed()
    if not pools:
        raise PoolError(lib.NP_ERR_STATE, "no npu_pool allocator is installed: call npu_pool.install() first, "
                        f"or use {instead} on a pool you created")
    chosen = list(pools.values()) if device is None else [pools[device]] if device in pools else []
    if not chosen:
        raise _invalid(f"no npu_pool allocator installed on device {device}; installed: {sorted(pools)}")
    return chosen


def set_compaction(on: bool, device: Optional[int] = None) -> None:
    """Compaction at an out-of-memory for the installed allocator (every device, or ``device``):
    see :meth:`Pool.set_compaction`, and ``NPU_POOL_COMPACT`` to set it at install."""
    pools = _chosen(device, "Pool.set_compaction()")
    for p in pools:
        p.set_compaction(on)


def compact(device: Optional[int] = None) -> int:
    """Compact the installed allocator's memory now (every device, or ``device``): see
    :meth:`Pool.compact`, which says where it is safe. Returns the bytes given back to the device."""
    return sum(p.compact() for p in _chosen(device, "Pool.compact()"))


def _set_fractions(pools: Any, fraction: float) -> None:
    """Cap every pool of ``pools`` at ``fraction``, or none: a device that refuses it (a cap below
    the smallest block, a planned region that would not fit) leaves the others as they were. Devices
    serving memory go first (they can refuse); those without a context keep it for their first
    allocation."""
    with _fractions:  # (two calls at once: each takes every device, neither undoes the other's)
        serving = sorted(pools, key=lambda p: not p.serving)
        done = []
        try:
            for p in serving:
                before = p.stats()["fraction"] if p.serving else None
                p.set_fraction(fraction)
                done.append((p, before))
        except PoolError:
            for p, before in reversed(done):
                if before is not None:
                    p.set_fraction(before)
            raise


def _importable(name: str) -> bool:
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _npu(torch: Any) -> tuple[Any, str]:
    """torch_npu's ``npu`` module, or why it is not usable."""
    if not _importable("torch_npu"):
        return None, (f"torch_npu is not installed (Ascend NPUs need the torch_npu build matching "
                      f"torch {torch.__version__})")
    try:
        import torch_npu
    except Exception as e:  # a broken CANN installation raises all sorts of errors
        return None, f"torch_npu failed to import ({type(e).__name__}: {e})"
    if not torch_npu.npu.is_available():
        return None, ("torch_npu sees no NPU (torch_npu.npu.is_available() is False: check the driver and "
                      "source CANN's set_env.sh)")
    return torch_npu.npu, ""


def _cuda(torch: Any) -> tuple[Any, str]:
    """``torch.cuda``, or why it is not usable."""
    if getattr(torch.version, "hip", None):
        return None, "torch is a ROCm build; npu_pool's GPU backend is CUDA only"
    if torch.version.cuda is None:
        return None, (f"torch {torch.__version__} is a CPU-only build without CUDA (torch.version.cuda is None): "
                      "install a CUDA build of torch")
    if not torch.cuda.is_available():
        return None, (f"torch (CUDA {torch.version.cuda}) sees no GPU (torch.cuda.is_available() is False: "
                      "check the driver and CUDA_VISIBLE_DEVICES)")
    return torch.cuda, ""


def _find_device(device_type: str, torch: Any) -> tuple[str, Any]:
    """("npu", torch_npu.npu) or ("cuda", torch.cuda) for ``device_type``."""
    reasons = []
    if device_type in ("auto", "npu"):
        mod, why = _npu(torch)
        if mod is not None:
            return "npu", mod
        if device_type == "npu":
            raise DeviceUnavailableError(f"npu_pool.install(device_type='npu'): {why}")
        reasons.append(why)
    mod, why = _cuda(torch)
    if mod is not None:
        return "cuda", mod
    if device_type == "cuda":
        raise DeviceUnavailableError(f"npu_pool.install(device_type='cuda'): {why}")
    reasons.append(why)
    raise DeviceUnavailableError("npu_pool.install() found no NPU or GPU: " + "; ".join(reasons))


def _too_late(kind: str) -> TooLateError:
    name = "NPU" if kind == "npu" else "CUDA"
    try:
        switched = config.load().enabled
    except config.ConfigError:
        switched = False
    if switched and "npu_pool_startup" not in sys.modules:  # the switch is on, yet its hook never ran
        fix = (f"{config.ENABLE} is set, but npu_pool's start-up hook did not run as this process started: either "
               "the variable was set after Python started (set it in the environment of the launch instead), or "
               "the package is not installed in this Python (the hook comes with `pip install`, as a .pth file in "
               "site-packages; a PYTHONPATH checkout or `python -S` has none). Or")
    else:
        fix = (f"Set {config.ENABLE}=1 in the environment of the launch (the package's start-up hook installs the "
               "pool as torch imports) or")
    return TooLateError(
        f"npu_pool.install() came too late: torch has already initialised its own {name} allocator "
        f"(a tensor was moved to the device, or torch.{kind} was initialised, e.g. by torch.{kind}.set_device), "
        f"and an initialised allocator cannot be swapped. {fix} call npu_pool.install() (or import mindspeed_patch) "
        "at the top of the training script: before the model is built and before any tensor is moved to the device.")


def _loaded_library(stem: str) -> Optional[str]:
    """Path of an already loaded library whose file name starts with ``stem`` (Linux)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                path = parts[5].strip() if len(parts) == 6 else ""
                if path.startswith("/") and path.rsplit("/", 1)[-1].startswith(stem):
                    return path
    except OSError:
        pass
    return None


def _default_lib_path(kind: str) -> Optional[str]:
    """Prefer the vendor library torch already loaded over a search by name."""
    if kind == "cuda":
        rt = _loaded_library("libcudart.so")
        return f"{rt}:" if rt else None  # "RUNTIME:" = this runtime, the default driver
    return _loaded_library("libascendcl.so")


def _register(handle: Any, setters: list[tuple[str, int]]) -> list[str]:
    """Give torch's allocator object the hooks it has setters for; returns the setters used."""
    used = []
    for setter, address in setters:
        if hasattr(handle, setter):
            getattr(handle, setter)(address)
            used.append(setter)
    return used


@ffi.def_extern()
def _npu_pool_on_oom(device: int, size: int, stream: Any) -> None:
    """Called by the core's torch hooks after a request failed for lack of memory: an OOM
    snapshot when one is asked for (npu_pool.oom); its note joins the device's error and the
    failing thread's (what the C++ hook raises)."""
    try:
        inst = _current
        pool = inst.pools.get(device) if inst else None
        note = oom.on_oom(pool, int(size), device) if pool is not None else None
        if note:
            lib.npu_pool_note_error(device, note.encode(errors="replace"))
        if pool is not None:
            from .torch_memory import notify_oom

            notify_oom(pool, device, int(size))  # torch's out-of-memory observers, after the snapshot
    except BaseException:  # nothing may escape into the C caller
        pass


def _hooks(kind: str) -> Any:
    """The C++ hooks of ``kind`` (npu_pool.cpp_hooks), or None with a warning saying what is lost."""
    from . import cpp_hooks

    try:
        return cpp_hooks.load(kind)
    except cpp_hooks.CacheUnusable as e:  # a directory the user named: their setting to mend, not a fallback
        raise config.ConfigError(f"{cpp_hooks.CACHE_ENV}: {e}") from None
    except cpp_hooks.HooksUnavailable as e:
        lost = ("Tensor.record_stream() does nothing (a tensor used on another NPU stream must then be kept alive "
                "until that stream is done, or the stream synchronised, before it is freed), torch.npu.memory_stats() "
                "and friends are answered from Python, and an out-of-memory request surfaces as torch_npu's "
                "'Get data_ptr failed'" if kind == "npu" else
                "an out-of-memory request is not raised by torch.empty(): the tensor it returns has no memory and "
                "fails at first use ('data is not allocated yet')")
        warnings.warn(f"npu_pool: {e}; using the C hooks only: {lost}, after npu_pool's explanation on stderr",
                      RuntimeWarning, stacklevel=5)  # (_hooks < _build_allocator < _prepare < install < caller)
        return None


def _build_allocator(kind: str, module: Any, torch: Any) -> tuple[Any, list[str], bool]:
    """torch's pluggable allocator over npu_pool, its hooks registered; (allocator, setters, C++ hooks)."""
    setters = [(s, _address(sym)) for s, sym in _HOOKS[kind]]
    pluggable = torch.cuda.memory.CUDAPluggableAllocator if kind == "cuda" else module.memory.NPUPluggableAllocator
    hooks = _hooks(kind)
    if hooks is None:
        allocator = pluggable(core_path(), "npu_pool_malloc", "npu_pool_free")
        return allocator, _register(allocator.allocator(), setters), False
    allocator = pluggable(hooks.path, hooks.MALLOC, hooks.FREE)
    cpp = hooks.setters()  # these replace the C hooks of the same setters
    used = _register(allocator.allocator(), [s for s in setters if s[0] not in dict(cpp)] + cpp)
    lib.npu_pool_set_quiet(1)  # the C++ malloc hook raises the failure: torch.OutOfMemoryError
    return allocator, used, True


def install(device_type: str = "auto", policy: Optional[str] = None, fraction: Optional[float] = None, *,
            lib_path: Optional[str] = None) -> dict[int, Pool]:
    """Install npu_pool as torch's device allocator; returns ``{device: Pool}``.

    ``device_type``: ``"auto"`` (an NPU through torch_npu if there is one, else CUDA),
    ``"npu"`` or ``"cuda"``. ``policy`` and ``fraction`` default to ``NPU_POOL_POLICY``
    (else ``"npu_pool"``) and ``NPU_POOL_FRACTION`` (else no cap). ``lib_path`` overrides
    the vendor library (as for :class:`~npu_pool.pool.Pool`). Raises
    :class:`DeviceUnavailableError` without an NPU or GPU and :class:`TooLateError` once
    torch has initialised its own allocator. All or nothing: every setting and file (the
    planned policy's plan included) is read and checked before torch's allocator is swapped,
    last; on any failure torch keeps its own allocator.
    """
    global _current
    if device_type not in ("auto", "npu", "cuda"):  # (before "already installed": a typo is said as one)
        raise ValueError(f"device_type must be 'auto', 'npu' or 'cuda', got {config.show(device_type)}")
    settings = config.load()
    policy = config.parse_policy(policy, "policy") if policy is not None else settings.policy
    if lib_path is not None:
        _lib_path(lib_path)  # (a path, before anything is touched)
    given = fraction is not None  # a repeated install applies only a fraction given here (not the setting again)
    if given:
        fraction = config.parse_fraction(fraction, "fraction")
    elif settings.fraction is not None:
        fraction = settings.fraction
    plan = None
    if policy == "planned":  # read and verified before anything changes, installed on every device
        if not settings.plan:
            raise InstallError(f"the planned policy needs a plan: set {config.PLAN} to a file from `npu-pool plan`")
        from .planner.plan import PlanError
        from .planner.runtime import as_plan

        try:
            plan = as_plan(settings.plan)
        except PlanError as e:
            raise PlanError(f"{config.PLAN}: {e}") from None
    elif settings.plan:
        src = settings.plan_source  # the variable, or the key in the YAML file
        undo = f"unset {src}" if src == config.PLAN else f"remove {src}"
        raise config.ConfigError(f"{src} names the plan {settings.plan!r}, which only the planned policy serves, but "
                                 f"the policy is {policy}: set {config.POLICY}=planned, or {undo}")
    if settings.compact:  # (the policy given here, not the setting's)
        config.check_compaction(policy, config.COMPACT)
    snapshots = oom.snapshot_setting()  # a file there is said now, not at the first out-of-memory (its snapshot lost)
    if snapshots is not None:  # (torch_npu's own switch names an optional folder: a warning only)
        config.parse_output_dir(*snapshots, unwritable_warns=snapshots[1] == oom.PATH)
    for line in config.unknown_variables():
        warnings.warn(f"npu_pool: {line}", RuntimeWarning, stacklevel=2)
    import torch

    with _lock:  # another device type than the installed one: that, not whether the type is here
        if _current is not None and device_type not in ("auto", _current.kind):
            raise _already(_current)
    kind, module = _find_device(device_type, torch)
    if plan is not None and not plan.meta.get("online"):  # (said before anything changes)
        from .planner.plan import PlanError
        from .planner.runtime import check_rules

        try:
            check_rules(plan, kind, f"this {kind} device applies")
        except PlanError as e:
            raise PlanError(f"{config.PLAN}: {e}") from None
    with _lock:
        if _current is not None:
            if (_current.kind, _current.policy) != (kind, policy):
                raise _already(_current)
            if lib_path and not _same_library(kind, lib_path, _current.lib_path):  # (it was ignored, silently)
                raise InstallError(f"npu_pool is already installed over {_current.lib_path or 'the default library'}; "
                                   f"lib_path={lib_path!r:.200} cannot change it in this process")
            if given:  # the cap set since (torch's set_per_process_memory_fraction included) stays otherwise
                try:
                    _set_fractions(_current.pools.values(), fraction)
                except PoolError as e:
                    raise config.ConfigError(f"fraction={fraction!r}: {e}") from None
                _current.fraction = fraction
            return dict(_current.pools)
        is_initialized = getattr(module, "is_initialized", None)
        if callable(is_initialized) and is_initialized():
            raise _too_late(kind)
        # (taken before _prepare routes torch's memory APIs: a later swap is refused, torch_memory.route)
        change = module.memory.change_current_allocator if kind == "npu" else torch.cuda.memory.change_current_allocator
        written = settings.origin  # where the settings in effect were set (mindspeed_patch passes them)
        origin = (written.get(config.POLICY, "") if policy == settings.policy else "",
                  written.get(config.FRACTION, "") if fraction == settings.fraction else "")
        inst = _prepare(kind, module, torch, policy, fraction, plan, lib_path, settings.compact, origin)
        inst.lib_path = lib_path
        try:  # the swap comes last: every failure before it left torch untouched
            change(inst.allocator)
        except BaseException as e:
            _undo(inst)
            if isinstance(e, RuntimeError) and ("initialized" in str(e) or "initialised" in str(e)):
                raise _too_late(kind) from e
            raise
        _current = inst
    from .alloc_conf import warn_ignored

    warn_ignored()  # PYTORCH_NPU_ALLOC_CONF and friends no longer apply: say so, once, naming each
    if plan is not None and not all(inst.plan_used):
        warnings.warn(f"{config.PLAN}={settings.plan}: the planner found this plan worse than the online pool "
                      f"({plan.meta.get('online', '')}); the planned policy serves every request online, "
                      "as npu_pool", RuntimeWarning, stacklevel=2)
    return dict(inst.pools)


def _same_library(kind: str, a: Optional[str], b: Optional[str]) -> bool:
    """Whether two lib_path values (None or "": the default) name one library."""
    def resolved(p: Optional[str]) -> Optional[str]:
        p = p or _default_lib_path(kind)
        return os.path.realpath(p) if p and "/" in p else p

    return resolved(a) == resolved(b)


def _already(current: _Installation) -> InstallError:
    try:
        by_switch = config.switched_on()  # (what the start-up hook read: the one rule of the switch)
    except config.ConfigError:
        by_switch = False
    how = (f" ({config.ENABLE} installed it at start-up: choose its policy and cap with {config.POLICY} and "
           f"{config.FRACTION}, or unset {config.ENABLE} to install it yourself)") if by_switch else ""
    return InstallError(f"npu_pool is already installed ({current.kind}, policy {current.policy}); "
                        f"a process can install one allocator, once{how}")


def _prepare(kind: str, module: Any, torch: Any, policy: str, fraction: Optional[float], plan: Any,
             lib_path: Optional[str], compact: bool = False, origin: tuple[str, str] = ("", "")) -> _Installation:
    """Everything install() does but the swap: the core's device table configured, torch's
    allocator object built with its hooks, the plan installed on every device, compaction asked
    for, torch's memory APIs routed. On any failure all of it is undone and the error raised
    (torch untouched)."""
    backend = _BACKEND_OF[kind]
    path = lib_path if lib_path is not None else _default_lib_path(kind)
    rc = lib.npu_pool_configure(POLICIES[policy], BACKENDS[backend], fraction or 1.0, 1,
                                _lib_path(path) if path else ffi.NULL)
    if rc:
        raise InstallError(f"npu_pool could not be configured: {last_error()}")
    lib.npu_pool_set_origin(*(text.encode() for text in origin))  # (named where a device's pool fails)
    inst: Optional[_Installation] = None
    try:
        devices = int(module.device_count())
        lib.npu_pool_set_device_count(devices)
        allocator, hooks, cpp = _build_allocator(kind, module, torch)
        inst = _Installation(kind, module, policy, backend, fraction, allocator, hooks, cpp)
        inst.pools = {d: _DevicePool(d, policy, backend) for d in range(devices)}
        if plan is not None:
            from .planner.runtime import install as install_plan

            inst.plan_used = [install_plan(p, plan) for p in inst.pools.values()]
        if compact:
            _check(lib.npu_pool_set_compaction(-1, 1))
        lib.npu_pool_set_oom_handler(lib._npu_pool_on_oom)
        if oom.snapshot_dir():  # OOM snapshots asked for: keep the run's history, as torch_npu would
            lib.npu_pool_set_history(-1, oom.HISTORY_WHEN_ENABLED)
        from . import torch_memory

        inst.unroute = torch_memory.route(kind, torch, lambda: dict(inst.pools), stats_from_python=not cpp)
    except BaseException:
        if inst is not None:
            _undo(inst)
        else:
            lib.npu_pool_shutdown()
        raise
    return inst


def _undo(inst: _Installation) -> None:
    """Take back what _prepare did (torch's allocator was not swapped)."""
    if inst.unroute:
        inst.unroute()
    lib.npu_pool_shutdown()


def _reset() -> None:
    """Forget the installation and destroy the device contexts (tests only: never while
    torch holds memory from the allocator)."""
    global _current
    with _lock:
        if _current is not None and _current.unroute:
            _current.unroute()
        _current = None
    lib.npu_pool_shutdown()


class _CallableModule(types.ModuleType):
    """``npu_pool.install`` is both this module and the function it exports: after
    ``import npu_pool.install`` the package attribute is the module, so the module
    forwards calls to :func:`install`."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[int, Pool]:
        return install(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
