"""``npu_pool.install()``: make npu_pool torch's device allocator.

Builds torch_npu's ``NPUPluggableAllocator`` or torch's ``CUDAPluggableAllocator`` over
the core's shared object (the C entry points of ``csrc/pluggable.h``), registers the
hooks whose C signatures match what torch calls, swaps it in, and records one
:class:`~npu_pool.pool.Pool` per device in ``npu_pool.pool._installed`` so that
:func:`npu_pool.set_fraction` and ``stats()`` work. It must run before torch allocates
device memory: import ``mindspeed_patch`` (with ``MEMORY_FRAGMENTATION=1``) or call
``npu_pool.install()`` at the top of the training script.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.util
import sys
import types
from typing import Any, Optional

from . import config
from .pool import BACKENDS, POLICIES, Pool, _check, ffi, lib as _core_api

__all__ = ["install", "InstallError", "DeviceUnavailableError", "TooLateError", "last_error", "core_path"]

# (setter on torch's allocator object, exported C symbol). Checked against torch 2.13's
# torch/csrc/cuda/CUDAPluggableAllocator.h and torch_npu's NPUPluggableAllocator:
#   set_init_fn              void(int device_count)             both
#   set_reset_fn             void()                             CUDA (torch.cuda.empty_cache)
#   set_reset_fn             void(bool check_error)             torch_npu (torch.npu.empty_cache)
#   set_memory_fraction_fn   void(double fraction, int device)  both
#   set_reset_peak_status_fn void(int device)                   torch_npu only
#   set_record_stream_fn     void(void* ptr, cudaStream_t)       CUDA
# Not registered: set_base_alloc_fn
# (IPC; virtual-memory pages cannot be shared that way), set_get_device_stats_fn (returns a C++
# DeviceStats by value), and the graph-pool hooks (take std::function / MempoolId_t).
_HOOKS: dict[str, tuple[tuple[str, str], ...]] = {
    "cuda": (("set_init_fn", "npu_pool_init"), ("set_reset_fn", "npu_pool_empty_cache"),
             ("set_memory_fraction_fn", "npu_pool_memory_fraction"),
             ("set_record_stream_fn", "npu_pool_record_stream")),
    "npu": (("set_init_fn", "npu_pool_init"), ("set_reset_fn", "npu_pool_empty_cache_checked"),
            ("set_memory_fraction_fn", "npu_pool_memory_fraction"),
            ("set_reset_peak_status_fn", "npu_pool_reset_peak")),
}
_BACKEND_OF = {"cuda": "cuda", "npu": "acl"}
_state: dict[str, Any] = {}  # what install() did: kind, policy, backend, fraction, allocator, hooks


class InstallError(RuntimeError):
    """npu_pool could not be installed as torch's device allocator."""


class DeviceUnavailableError(InstallError):
    """Neither an Ascend NPU (torch_npu) nor a CUDA GPU is usable."""


class TooLateError(InstallError):
    """torch already initialised its own device allocator."""


def core_path() -> str:
    """Path of the core's shared object, which exports the allocator entry points."""
    from . import _core

    return _core.__file__


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    """The core's shared object through ctypes (the same loaded object as ``npu_pool._core``)."""
    c = ctypes
    so = c.CDLL(core_path())
    sigs = {
        "npu_pool_configure": (c.c_int, [c.c_int, c.c_int, c.c_double, c.c_int, c.c_char_p]),
        "npu_pool_device_ctx": (c.c_void_p, [c.c_int]),
        "npu_pool_set_fraction": (c.c_int, [c.c_int, c.c_double]),
        "npu_pool_last_error": (c.c_size_t, [c.c_int, c.c_char_p, c.c_size_t]),
        "npu_pool_shutdown": (None, []),
        "npu_pool_malloc": (c.c_void_p, [c.c_size_t, c.c_int, c.c_void_p]),
        "npu_pool_free": (None, [c.c_void_p, c.c_size_t, c.c_int, c.c_void_p]),
        "npu_pool_init": (None, [c.c_int]),
        "npu_pool_empty_cache": (None, []),
        "npu_pool_empty_cache_checked": (None, [c.c_bool]),
        "npu_pool_memory_fraction": (None, [c.c_double, c.c_int]),
        "npu_pool_reset_peak": (None, [c.c_int]),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(so, name)
        fn.restype, fn.argtypes = restype, argtypes
    return so


def last_error(device: int = -1) -> str:
    """The last failure the allocator hooks met on ``device`` (also printed to stderr);
    ``device=-1``: the calling thread's last core error."""
    buf = ctypes.create_string_buffer(1024)
    _lib().npu_pool_last_error(device, buf, len(buf))
    return buf.value.decode(errors="replace")


class _DevicePool(Pool):
    """The installed allocator's context on one device. The context belongs to the
    shared object's device table: it is created on first use and never closed here."""

    def __init__(self, device: int, policy: str, backend: str):  # no Pool.__init__: nothing to create
        self._ctx = None
        self.device = device
        self.policy = policy
        self.backend = backend

    @property
    def ctx(self) -> Any:
        if self._ctx is None:
            addr = _lib().npu_pool_device_ctx(self.device)
            if not addr:
                _check(_core_api.NP_ERR_BACKEND)
            self._ctx = ffi.cast("np_ctx *", addr)
        return self._ctx

    def set_fraction(self, fraction: float) -> None:
        """Cap this device at ``fraction`` of its memory (applied when its context exists)."""
        _check(_lib().npu_pool_set_fraction(self.device, float(fraction)))

    def close(self) -> None:
        self._ctx = None


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
    if device_type not in ("auto", "npu", "cuda"):
        raise ValueError(f"device_type must be 'auto', 'npu' or 'cuda', got {device_type!r}")
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
    return TooLateError(
        f"npu_pool.install() came too late: torch has already initialised its own {name} allocator "
        f"(a tensor was moved to the device, or torch.{kind} was initialised, e.g. by torch.{kind}.set_device), "
        "and an initialised allocator cannot be swapped. Import mindspeed_patch (with MEMORY_FRAGMENTATION=1) or call "
        "npu_pool.install() at the top of the training script: before the model is built and before any tensor "
        "is moved to the device.")


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


def _register_hooks(handle: Any, kind: str) -> list[str]:
    """Give torch's allocator object the hooks it has setters for; returns the setters used."""
    used = []
    for setter, symbol in _HOOKS[kind]:
        if hasattr(handle, setter):
            getattr(handle, setter)(ctypes.cast(getattr(_lib(), symbol), ctypes.c_void_p).value)
            used.append(setter)
    return used


def _pools(kind: str, module: Any, policy: str, backend: str) -> dict[int, Pool]:
    from . import pool

    count = int(module.device_count())
    pools: dict[int, Pool] = {d: _DevicePool(d, policy, backend) for d in range(count)}
    pool._installed.update(pools)
    return pools


def install(device_type: str = "auto", policy: Optional[str] = None, fraction: Optional[float] = None, *,
            lib_path: Optional[str] = None) -> dict[int, Pool]:
    """Install npu_pool as torch's device allocator; returns ``{device: Pool}``.

    ``device_type``: ``"auto"`` (an NPU through torch_npu if there is one, else CUDA),
    ``"npu"`` or ``"cuda"``. ``policy`` and ``fraction`` default to ``NPU_POOL_POLICY``
    (else ``"npu_pool"``) and ``NPU_POOL_FRACTION`` (else no cap). ``lib_path`` overrides
    the vendor library (as for :class:`~npu_pool.pool.Pool`). Raises
    :class:`DeviceUnavailableError` without an NPU or GPU and :class:`TooLateError` once
    torch has initialised its own allocator.
    """
    settings = config.load()
    policy = config.parse_policy(policy, "policy") if policy is not None else settings.policy
    if fraction is not None:
        fraction = config.parse_fraction(fraction, "fraction")
    elif settings.fraction is not None:
        fraction = settings.fraction
    import torch

    kind, module = _find_device(device_type, torch)
    if _state:
        if (_state["kind"], _state["policy"]) == (kind, policy):
            from . import pool

            pools = {d: p for d, p in pool._installed.items() if isinstance(p, _DevicePool)}
            if fraction is not None:
                for p in pools.values():
                    p.set_fraction(fraction)
                _state["fraction"] = fraction
            return pools
        raise InstallError(f"npu_pool is already installed ({_state['kind']}, policy {_state['policy']}); "
                           "a process can install one allocator, once")
    is_initialized = getattr(module, "is_initialized", None)
    if callable(is_initialized) and is_initialized():
        raise _too_late(kind)
    backend = _BACKEND_OF[kind]
    path = lib_path if lib_path is not None else _default_lib_path(kind)
    rc = _lib().npu_pool_configure(POLICIES[policy], BACKENDS[backend], fraction or 1.0, 1,
                                   path.encode() if path else None)
    if rc:
        raise InstallError(f"npu_pool could not be configured: {last_error()}")
    so = core_path()
    if kind == "npu":
        allocator = module.memory.NPUPluggableAllocator(so, "npu_pool_malloc", "npu_pool_free")
        change = module.memory.change_current_allocator
    else:
        allocator = torch.cuda.memory.CUDAPluggableAllocator(so, "npu_pool_malloc", "npu_pool_free")
        change = torch.cuda.memory.change_current_allocator
    hooks = _register_hooks(allocator.allocator(), kind)
    try:
        change(allocator)
    except RuntimeError as e:
        if "initialized" in str(e) or "initialised" in str(e):
            raise _too_late(kind) from e
        raise
    _state.update(kind=kind, policy=policy, backend=backend, fraction=fraction, allocator=allocator, hooks=hooks)
    pools = _pools(kind, module, policy, backend)
    if policy == "planned":
        if not settings.plan:
            raise InstallError(f"the planned policy needs a plan: set {config.PLAN} to a file from `npu-pool plan`")
        for p in pools.values():
            p.load_plan(settings.plan)
    return pools


def _reset() -> None:
    """Forget the installation and destroy the device contexts (tests only: never while
    torch holds memory from the allocator)."""
    from . import pool

    for d in [d for d, p in pool._installed.items() if isinstance(p, _DevicePool)]:
        del pool._installed[d]
    _state.clear()
    _lib().npu_pool_shutdown()


class _CallableModule(types.ModuleType):
    """``npu_pool.install`` is both this module and the function it exports: after
    ``import npu_pool.install`` the package attribute is the module, so the module
    forwards calls to :func:`install`."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[int, Pool]:
        return install(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
