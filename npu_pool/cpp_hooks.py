"""The C++ hooks of torch's pluggable allocators, built on first use against the installed
torch (and torch_npu) headers and cached: ``shim/torch_npu_hooks.cpp`` for torch_npu's
NPUPluggableAllocator, ``shim/torch_cuda_hooks.cpp`` for torch's CUDAPluggableAllocator.

Only a C++ malloc hook can raise ``torch.OutOfMemoryError`` (a C one returns NULL, which neither
pluggable allocator checks: ``shim/malloc_hook.h``). torch_npu's ``set_get_device_stats_fn``
also wants a function returning a C++ ``DeviceStats`` (it holds a hash map: no C function can
fake it; without one, ``torch.npu.memory_stats()`` reads garbage and aborts), and
``set_record_stream_fn`` and ``set_erase_stream_fn`` pass a ``c10_npu::NPUStream``. A
library is compiled once per (source, torch, torch_npu, compiler) with ``$CXX`` (split as a
shell would: ``CXX="ccache g++"``; else g++) into ``$NPU_POOL_CACHE`` (else
``$XDG_CACHE_HOME/npu_pool``, else ``~/.cache/npu_pool``); concurrent ranks wait for one build. Beside each library a ``.sum`` file holds its size and
SHA-256: a cached library that does not match (truncated, overwritten, half copied) is rebuilt,
never loaded (loading a truncated library kills the process with SIGBUS). Any failure raises
:class:`HooksUnavailable` saying why.
"""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ._core import ffi, lib
from .inputs import open_regular

SHIM = Path(__file__).resolve().parent / "shim"
SOURCES = {"npu": SHIM / "torch_npu_hooks.cpp", "cuda": SHIM / "torch_cuda_hooks.cpp"}
CACHE_ENV = "NPU_POOL_CACHE"

__all__ = ["Hooks", "HooksUnavailable", "load", "build", "cache_dir"]


class HooksUnavailable(RuntimeError):
    """The C++ hooks could not be built or loaded (the message says why)."""


class CacheUnusable(HooksUnavailable):
    """The directory the user named with NPU_POOL_CACHE cannot hold the hooks: their setting, not the machine."""


def _unusable(message: str) -> HooksUnavailable:
    """The cache directory cannot be used: the user's mistake when they named it (CacheUnusable)."""
    return (CacheUnusable if os.environ.get(CACHE_ENV, "").strip() else HooksUnavailable)(message)


def cache_dir() -> Path:
    """Where built hooks are kept."""
    if os.environ.get(CACHE_ENV, "").strip():
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "npu_pool"


def _compiler() -> list[str]:
    """The compiler's words: ``$CXX`` split as a shell would (``ccache g++``), else g++ or c++."""
    cxx = os.environ.get("CXX", "").strip()
    if cxx:
        try:
            words = shlex.split(cxx)
        except ValueError as e:
            raise HooksUnavailable(f"CXX={cxx!r:.80} cannot be read as a command ({e})") from None
        if words:
            return words
    found = shutil.which("g++") or shutil.which("c++")
    if not found:
        raise HooksUnavailable("no C++ compiler (set CXX, or install g++) to build npu_pool's C++ hooks")
    return [found]


def _command(cxx: list[str], kind: str) -> list[str]:
    """The compiler's command line for ``kind``'s hooks, less its output file."""
    import torch

    torch_dir = Path(torch.__file__).parent
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    core_h = Path(__file__).resolve().parent / "csrc"
    cmd = [*cxx, "-std=c++17", "-O2", "-shared", "-fPIC", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
           f"-I{torch_dir / 'include'}", f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
           f"-I{core_h}", f"-I{SHIM}"]
    libs = [f"-L{torch_dir / 'lib'}", "-lc10", f"-Wl,-rpath,{torch_dir / 'lib'}"]
    if kind == "cuda":
        return cmd + [str(SOURCES[kind])] + libs
    import torch_npu

    npu_dir = Path(torch_npu.__file__).parent
    return (cmd + [f"-I{npu_dir / 'include'}", f"-I{npu_dir / 'include' / 'third_party' / 'acl' / 'inc'}",
                   str(SOURCES[kind]), f"-L{npu_dir / 'lib'}", "-ltorch_npu", f"-Wl,-rpath,{npu_dir / 'lib'}"] + libs)


def _key(cxx: list[str], kind: str) -> str:
    import torch

    versions = [torch.__version__]
    if kind == "npu":
        import torch_npu

        versions.append(str(getattr(torch_npu, "__version__", "")))
    h = hashlib.sha256()
    for part in (SOURCES[kind].read_bytes(), (SHIM / "malloc_hook.h").read_bytes(),
                 (Path(__file__).parent / "csrc" / "npu_pool.h").read_bytes(),
                 *(v.encode() for v in versions), shlex.join(cxx).encode(), sys.version.encode()):
        h.update(part)
    return h.hexdigest()[:16]


def build(kind: str = "npu") -> Path:
    """The hooks library of ``kind`` ("npu": torch_npu's, "cuda": torch's) for the installed
    torch, built now if not cached."""
    if kind not in SOURCES:
        raise ValueError(f"no C++ hooks for {kind!r}; kinds: {', '.join(SOURCES)}")
    framework = "torch_npu" if kind == "npu" else "torch"
    try:
        __import__(framework)
    except Exception as e:
        raise HooksUnavailable(f"{framework} cannot be imported ({type(e).__name__}: {e})") from None
    cxx = _compiler()
    try:
        key = _key(cxx, kind)
        cmd = _command(cxx, kind)
    except (AttributeError, TypeError, OSError) as e:  # a framework without its files (a stand-in)
        raise HooksUnavailable(f"{framework}'s headers cannot be found ({e})") from None
    out_dir = cache_dir()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fix = (f"{CACHE_ENV}={os.environ[CACHE_ENV]} is not a directory this process can create or use"
               if os.environ.get(CACHE_ENV, "").strip() else f"set {CACHE_ENV} to a writable directory")
        raise _unusable(f"cannot create the cache directory {out_dir} ({e.strerror}): {fix}") from None
    out = out_dir / f"{SOURCES[kind].stem}-{key}.so"
    if _verified(out):
        return out
    try:
        lock = open(out_dir / ".build.lock", "w")
    except OSError as e:
        raise _unusable(f"cannot write to the cache directory {out_dir} ({e.strerror}); set {CACHE_ENV}") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # ranks starting together build once
        if _verified(out):
            return out
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        try:
            r = subprocess.run(cmd + ["-o", str(tmp)], capture_output=True, text=True)
        except OSError as e:
            raise HooksUnavailable(f"cannot run the C++ compiler {shlex.join(cxx)} ({e.strerror})") from None
        if r.returncode != 0:
            tmp.unlink(missing_ok=True)
            tail = "\n".join(r.stderr.strip().splitlines()[-15:])
            raise HooksUnavailable(f"building npu_pool's {framework} hooks with {shlex.join(cxx)} failed:\n{tail}")
        try:
            _seal(tmp, _sum_path(out))
            os.replace(tmp, out)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise _unusable(f"cannot write the hooks into {out_dir} ({e.strerror}); set {CACHE_ENV}") from None
    if not _verified(out):
        raise HooksUnavailable(f"{out} changed while it was being built (another process writing the cache?)")
    return out


def _sum_path(lib_path: Path) -> Path:
    return lib_path.with_name(lib_path.name + ".sum")


def _digest(path: Path) -> tuple[int, str]:
    """(size, SHA-256) of a regular file; OSError otherwise."""
    h = hashlib.sha256()
    size = 0
    with open_regular(path) as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _seal(built: Path, sum_path: Path) -> None:
    """Write the size and checksum of ``built`` (the library about to be renamed into place)."""
    size, digest = _digest(built)
    tmp = sum_path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(f"{size} {digest}\n")
    os.replace(tmp, sum_path)


def _verified(lib_path: Path) -> bool:
    """Whether ``lib_path`` exists and matches the size and checksum written beside it."""
    try:
        with open(_sum_path(lib_path), "rb") as f:
            expected = f.read(200).decode("ascii").split()
        if len(expected) != 2 or os.stat(lib_path).st_size != int(expected[0]):
            return False  # the cheap check first: a truncated library is not even read
        size, digest = _digest(lib_path)
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return expected == [str(size), digest]


@dataclass(frozen=True)
class Hooks:
    """The loaded hooks: their library and the addresses the pluggable allocator's setters take
    beyond malloc and free (the memory fraction's; the others torch_npu's only)."""

    path: str
    memory_fraction: int = 0
    stats: int = 0
    record_stream: int = 0
    erase_stream: int = 0
    MALLOC = "npu_pool_hooks_malloc"
    FREE = "npu_pool_hooks_free"

    def setters(self) -> list[tuple[str, int]]:
        return [(name, address) for name, address in (("set_memory_fraction_fn", self.memory_fraction),
                                                      ("set_get_device_stats_fn", self.stats),
                                                      ("set_record_stream_fn", self.record_stream),
                                                      ("set_erase_stream_fn", self.erase_stream)) if address]


def _addr(symbol: str) -> int:
    return int(ffi.cast("uintptr_t", ffi.addressof(lib, symbol)))


def load(kind: str = "npu") -> Hooks:
    """Build (if needed) and load ``kind``'s hooks, bound to the core's entry points (once per kind
    and process; an unknown kind is refused by :func:`build`)."""
    return _load(kind)  # (positional: one cache entry per kind, however the caller spelled it)


@lru_cache(maxsize=None)
def _load(kind: str) -> Hooks:
    """:func:`load`, once per kind (``load.cache_clear()`` forgets the loaded ones)."""
    path = build(kind)
    try:
        so = ctypes.CDLL(str(path))
    except OSError as e:
        raise HooksUnavailable(f"cannot load {path}: {e}") from None
    malloc_free = [_addr("npu_pool_malloc"), _addr("npu_pool_free")]
    last = [_addr("npu_pool_last_error"), _addr("npu_pool_last_code"), _addr("npu_pool_set_fraction")]  # both bind these last

    def address(name: str) -> int:
        return int(ctypes.cast(getattr(so, name), ctypes.c_void_p).value or 0)

    if kind == "cuda":
        so.npu_pool_hooks_bind.argtypes = [ctypes.c_void_p] * 5
        so.npu_pool_hooks_bind(*malloc_free, *last)
        return Hooks(str(path), address("npu_pool_hooks_memory_fraction"))
    so.npu_pool_hooks_bind.argtypes = [ctypes.c_void_p] * 7
    so.npu_pool_hooks_bind(*malloc_free, _addr("npu_pool_device_stats"), _addr("npu_pool_record_stream"), *last)
    # the core's device synchronisations go through torch_npu's (its task queue emptied first), and
    # its handovers between streams through torch_npu's events (recorded and waited through that queue)
    lib.npu_pool_set_framework_sync(ffi.cast("int (*)(void)", address("npu_pool_hooks_synchronize")))
    lib.npu_pool_set_framework_stream_wait(ffi.cast("int (*)(int, void *, void *)",
                                                    address("npu_pool_hooks_stream_wait")))
    return Hooks(str(path), address("npu_pool_hooks_memory_fraction"), address("npu_pool_hooks_device_stats"),
                 address("npu_pool_hooks_record_stream"), address("npu_pool_hooks_erase_stream"))


load.cache_clear = _load.cache_clear  # type: ignore[attr-defined]
