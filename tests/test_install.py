"""Settings, the pluggable-allocator entry points of the core's shared object, npu_pool.install()
on CUDA (against a stand-in for torch.cuda, since this machine has no GPU; the real torch_npu
is driven by test_torch_npu.py) and ``import mindspeed_patch``."""
from __future__ import annotations

import ctypes
import importlib
import os
import re
import subprocess
import sys
import threading
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import npu_pool
from npu_pool import config, torch_memory
from npu_pool._core import ffi, lib as so
from npu_pool.config import ConfigError
from npu_pool.pool import BACKENDS, POLICIES, InvalidArgumentError, PoolError

from test_backends import MiB, Vendor, _compiler, FAKES
from conftest import unavailable

ROOT = Path(__file__).resolve().parent.parent
inst = importlib.import_module("npu_pool.install")  # the module (npu_pool.install is it too, callable)
c = ctypes


# ---- settings ------------------------------------------------------------------------------

def test_defaults_and_environment() -> None:
    assert config.load({}) == config.Config(enabled=False, fraction=None, policy="npu_pool")
    env = {"MEMORY_FRAGMENTATION": "1", "NPU_POOL_FRACTION": " 0.8 ", "NPU_POOL_POLICY": "torch"}
    assert config.load(env) == config.Config(enabled=True, fraction=0.8, policy="torch")
    assert config.POLICY_NAMES == tuple(POLICIES)


@pytest.mark.parametrize("var, value, accepted", [
    ("MEMORY_FRAGMENTATION", "yes", "0 (off) or 1 (on)"),
    ("MEMORY_FRAGMENTATION", "2", "0 (off) or 1 (on)"),
    ("NPU_POOL_FRACTION", "0", "(0, 1]"),
    ("NPU_POOL_FRACTION", "1.5", "(0, 1]"),
    ("NPU_POOL_FRACTION", "nan", "(0, 1]"),
    ("NPU_POOL_FRACTION", "most", "(0, 1]"),
    ("NPU_POOL_POLICY", "caching", "torch, npu_pool, expandable, planned"),
    ("NPU_POOL_PLAN", "/nonexistent.plan", "a plan file written by `npu-pool plan`"),
    ("NPU_POOL_COMPACT", "on", "0 (off) or 1 (on)"),
])
def test_bad_values_name_the_variable_and_the_choices(var: str, value: str, accepted: str) -> None:
    with pytest.raises(ConfigError) as e:
        config.load({var: value})
    assert var in str(e.value) and repr(value) in str(e.value) and accepted in str(e.value)


def test_compaction_setting_and_the_policies_it_applies_to() -> None:
    assert config.load({"NPU_POOL_COMPACT": " 1 "}).compact is True
    assert config.load({"NPU_POOL_COMPACT": "0"}).compact is False and config.load({}).compact is False
    with pytest.raises(ConfigError, match="NPU_POOL_COMPACT=1 applies to the npu_pool and planned policies, but the "
                                          "policy is torch"):
        config.load({"NPU_POOL_COMPACT": "1", "NPU_POOL_POLICY": "torch"})


def test_planned_policy_needs_a_plan(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="NPU_POOL_POLICY=planned needs NPU_POOL_PLAN"):
        config.load({"NPU_POOL_POLICY": "planned"})
    plan = tmp_path / "p.plan"
    plan.write_bytes(b"x")
    assert config.load({"NPU_POOL_POLICY": "planned", "NPU_POOL_PLAN": str(plan)}).plan == str(plan)


def test_yaml_file_with_environment_overrides(tmp_path: Path) -> None:
    f = tmp_path / "pool.yaml"
    f.write_text("memory_fragmentation: true\nnpu_pool_fraction: 0.5\nnpu_pool_policy: expandable\n")
    assert config.load({"NPU_POOL_CONFIG": str(f)}) == config.Config(True, 0.5, "expandable")
    env = {"NPU_POOL_CONFIG": str(f), "NPU_POOL_FRACTION": "0.9", "MEMORY_FRAGMENTATION": "0"}
    assert config.load(env) == config.Config(False, 0.9, "expandable")
    # where each setting in effect was written (named where a device's pool cannot be made)
    assert config.load(env).origin == {"NPU_POOL_POLICY": f"npu_pool_policy='expandable' (in {f})",
                                             "NPU_POOL_FRACTION": "NPU_POOL_FRACTION='0.9'"}


@pytest.mark.parametrize("text, message", [
    ("npu_pool_fraction: 2\n", "npu_pool_fraction in"),
    ("fraction: 0.5\n", "unknown key 'fraction'; accepted keys: memory_fragmentation, npu_pool_fraction"),
    ("- 1\n- 2\n", "expected a mapping"),
    ("a: [\n", "not valid YAML"),
    ("npu_pool_fraction: 0.5\nnpu_pool_fraction: 0.9\n", "line 2: 'npu_pool_fraction' is given twice"),
])
def test_bad_yaml_files(tmp_path: Path, text: str, message: str) -> None:
    f = tmp_path / "pool.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        config.load({"NPU_POOL_CONFIG": str(f)})
    with pytest.raises(ConfigError, match="NPU_POOL_CONFIG='/nonexistent.yaml': cannot read"):
        config.load({"NPU_POOL_CONFIG": "/nonexistent.yaml"})


# ---- the C entry points -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def fakes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    cc = _compiler()
    if cc is None:
        pytest.skip("no C compiler to build the fake vendor libraries")
    out = tmp_path_factory.mktemp("fakes")
    paths = {}
    for vendor in ("acl", "cuda"):
        so = out / f"libfake_{vendor}.so"
        subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(so), str(FAKES / f"fake_{vendor}.c"), "-lpthread"],
                       check=True, capture_output=True)
        paths[vendor] = str(so)
    return paths


@pytest.fixture(autouse=True)
def clean_install() -> Any:
    inst._reset()
    yield
    inst._reset()


def _vendor(fakes: dict[str, str], backend: str) -> Vendor:
    v = Vendor(backend, fakes[backend], ctypes.CDLL(fakes[backend]))
    v.lib.fake_set_capacity(256 * MiB)
    return v


def _configure(v: Vendor, policy: str = "npu_pool", fraction: float = 1.0) -> None:
    rc = so.npu_pool_configure(POLICIES[policy], BACKENDS[v.backend], fraction, 1, v.path.encode())
    assert rc == 0, inst.last_error()


def malloc(size: int, device: int = 0, stream: int = 0) -> int:
    """The torch malloc hook, as torch calls it; the address (0: failed)."""
    return int(ffi.cast("uintptr_t", so.npu_pool_malloc(size, device, ffi.cast("void *", stream))))


def free(ptr: int, device: int = 0, stream: int = 0) -> None:
    so.npu_pool_free(ffi.cast("void *", ptr), 0, device, ffi.cast("void *", stream))


@pytest.mark.parametrize("backend", ["acl", "cuda"])
def test_hooks_allocate_free_and_empty_cache(fakes: dict, backend: str) -> None:
    v = _vendor(fakes, backend)
    _configure(v)
    ptrs = [malloc(n, 0, 0x1234) for n in (1000, 3 * MiB, 5 * MiB)]
    assert all(ptrs)
    for i, p in enumerate(ptrs):
        ctypes.memset(p, i + 1, 1000)
    assert ctypes.string_at(ptrs[2], 1000) == b"\x03" * 1000
    pool = inst._DevicePool(0, "npu_pool", backend)
    for p in ptrs:
        free(p, 0, 0x1234)
    st = pool.stats()
    assert st["allocs"] == 3 and st["frees"] == 3 and v.lib.fake_mapped() > 0
    so.npu_pool_empty_cache() if backend == "cuda" else so.npu_pool_empty_cache_checked(True)
    assert v.lib.fake_mapped() == 0
    assert malloc(0) == 0 and inst.last_error(0) == ""  # empty storage: no memory, no error


def test_acl_requests_get_32_bytes_of_padding(fakes: dict) -> None:
    sizes = {}
    for backend in ("acl", "cuda"):
        inst._reset()
        _configure(_vendor(fakes, backend))
        p = malloc(481)
        sizes[backend] = inst._DevicePool(0, "npu_pool", backend).block_size(p)
    assert sizes == {"acl": 1024, "cuda": 512}  # 481 -> 512 + 32 on Ascend


def test_fraction_hook_before_and_after_the_context_exists(fakes: dict, capfd: pytest.CaptureFixture) -> None:
    _configure(_vendor(fakes, "cuda"))
    so.npu_pool_memory_fraction(0.5, 1)  # device 1 has no context yet: pending
    pool = inst._DevicePool(1, "npu_pool", "cuda")
    assert not pool.serving and pool.stats()["limit"] == 0  # statistics do not make a context
    free(malloc(MiB, 1), 1)
    assert pool.serving and pool.stats()["limit"] == 128 * MiB
    so.npu_pool_memory_fraction(0.25, 1)
    assert pool.stats()["limit"] == 64 * MiB
    so.npu_pool_memory_fraction(0.0, 1)  # torch allows 0; the core does not: reported, not raised
    assert "memory fraction must be in (0, 1]" in capfd.readouterr().err
    assert "memory fraction" in inst.last_error(1) and pool.stats()["limit"] == 64 * MiB


def test_reset_peak_hook(fakes: dict) -> None:
    _configure(_vendor(fakes, "acl"))
    free(malloc(4 * MiB))
    pool = inst._DevicePool(0, "npu_pool", "acl")
    assert pool.stats()["total"]["allocated"]["peak"] > 0
    so.npu_pool_reset_peak(0)
    assert pool.stats()["total"]["allocated"]["peak"] == 0


def test_failures_return_null_and_keep_the_message(fakes: dict, capfd: pytest.CaptureFixture) -> None:
    assert malloc(100) == 0  # nothing configured yet
    assert "not configured" in inst.last_error(0)
    v = _vendor(fakes, "cuda")
    _configure(v)
    keep = malloc(MiB)
    assert malloc(1 << 40) == 0
    assert "out of memory on device 0" in inst.last_error(0)
    assert "npu_pool: malloc failed on device 0: out of memory" in capfd.readouterr().err
    assert malloc(1 << 40) == 0  # the same failure again, nothing served in between: not printed twice
    assert capfd.readouterr().err == ""
    free(keep + 512)  # a pointer the pool never returned: reported, not fatal
    assert "not an allocated block" in inst.last_error(0) or "double free" in inst.last_error(0)
    assert malloc(100, 99) == 0 and "out of range" in inst.last_error(-1)
    free(keep)
    inst._DevicePool(0, "npu_pool", "cuda").check()


def test_quiet_malloc_failures_are_kept_not_printed(fakes: dict, capfd: pytest.CaptureFixture) -> None:
    """With the C++ hooks installed (npu_pool_set_quiet(1)) the hook raises what malloc kept:
    nothing is printed as well, a failure to create the allocator included."""
    so.npu_pool_set_quiet(1)
    assert malloc(100) == 0 and "not configured" in inst.last_error(0)  # creating the allocator failed
    _configure(_vendor(fakes, "cuda"))
    assert malloc(1 << 40) == 0 and "out of memory on device 0" in inst.last_error(0)
    assert capfd.readouterr().err == ""


def test_configuration_is_fixed_once_a_device_is_served(fakes: dict) -> None:
    v = _vendor(fakes, "cuda")
    _configure(v)
    assert malloc(100)
    _configure(v)  # the same configuration again is fine
    rc = so.npu_pool_configure(POLICIES["torch"], BACKENDS["cuda"], 1.0, 1, v.path.encode())
    assert rc == 7 and "before the first allocation" in inst.last_error()  # NP_ERR_STATE


def test_hooks_are_thread_safe(fakes: dict) -> None:
    _configure(_vendor(fakes, "cuda"))
    errors: list[str] = []

    def work(seed: int) -> None:
        live = []
        for i in range(300):
            p = malloc(512 * (1 + (seed * 7 + i) % 97), 0, seed)
            if not p:
                errors.append(inst.last_error(0))
                return
            ctypes.memset(p, seed, 64)
            live.append(p)
            if len(live) > 8:
                q = live.pop(0)
                if ctypes.string_at(q, 64) != bytes([seed]) * 64:
                    errors.append("corrupted")
                free(q, 0, seed)
        for q in live:
            free(q, 0, seed)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    pool = inst._DevicePool(0, "npu_pool", "cuda")
    pool.check()
    assert pool.stats()["allocs"] == pool.stats()["frees"] == 1200


def test_a_failed_malloc_keeps_its_own_message_and_note_per_thread(fakes: dict, capfd: pytest.CaptureFixture) -> None:
    """What a failed malloc raises (the C++ hooks read npu_pool_last_error(-1)) and prints is the
    calling thread's failure, with the note its OOM handler added, whatever another thread's
    failure on the same device reported meanwhile: here the second thread fails while the first
    one's handler runs (writing a snapshot takes that long)."""
    _configure(_vendor(fakes, "cuda"))
    in_handler, other_failed = threading.Event(), threading.Event()

    @ffi.callback("void(int, uint64_t, void *)")
    def on_oom(device: int, size: int, stream: Any) -> None:
        so.npu_pool_note_error(device, f"snapshot for {size}".encode())
        if size == 1 << 40:
            in_handler.set()
            other_failed.wait(30)

    so.npu_pool_set_oom_handler(on_oom)
    seen: dict[str, Any] = {}

    def first() -> None:
        seen["first"] = malloc(1 << 40)
        seen["own"], seen["code"] = inst.last_error(-1), so.npu_pool_last_code()

    def second() -> None:
        in_handler.wait(30)
        seen["second"] = malloc(3 << 40)
        other_failed.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen["first"] == seen["second"] == 0
    assert "out of memory on device 0" in seen["own"] and seen["code"] == so.NP_ERR_OOM
    assert f"snapshot for {1 << 40}" in seen["own"] and f"snapshot for {3 << 40}" not in seen["own"]
    device = inst.last_error(0)  # the device's last failure: the second thread's
    assert f"snapshot for {3 << 40}" in device and f"snapshot for {1 << 40}" not in device
    err = capfd.readouterr().err  # each thread printed its own report, neither taken for a repeat
    assert err.count("npu_pool: malloc failed on device 0") == 2
    assert f"snapshot for {1 << 40}" in err and f"snapshot for {3 << 40}" in err


def test_an_oom_handler_that_fails_to_allocate_keeps_the_notes_apart(fakes: dict) -> None:
    """A handler whose own malloc fails nests: its note goes with its own failure, not the outer one."""
    _configure(_vendor(fakes, "cuda"))
    so.npu_pool_set_quiet(1)
    inner: dict[str, str] = {}

    @ffi.callback("void(int, uint64_t, void *)")
    def on_oom(device: int, size: int, stream: Any) -> None:
        so.npu_pool_note_error(device, f"before {size}".encode())
        if size == 1 << 40:
            assert malloc(3 << 40) == 0
            inner["own"] = inst.last_error(-1)
        so.npu_pool_note_error(device, f"after {size}".encode())

    so.npu_pool_set_oom_handler(on_oom)
    assert malloc(1 << 40) == 0
    outer = inst.last_error(-1)
    assert f"before {1 << 40}" in outer and f"after {1 << 40}" in outer and str(3 << 40) not in outer
    assert f"before {3 << 40}" in inner["own"] and f"after {3 << 40}" in inner["own"]
    assert str(1 << 40) not in inner["own"].split("\n", 1)[1]  # its notes: the inner request's only


def test_a_note_too_long_to_keep_is_cut_visibly(fakes: dict) -> None:
    """A handler's note longer than the message can keep is cut, and the cut shows ('...' at the
    end of the thread's message and of the device's), instead of ending mid-word as if whole."""
    _configure(_vendor(fakes, "cuda"))
    so.npu_pool_set_quiet(1)

    @ffi.callback("void(int, uint64_t, void *)")
    def on_oom(device: int, size: int, stream: Any) -> None:
        so.npu_pool_note_error(device, b"snapshot: " + b"x" * 5000)

    so.npu_pool_set_oom_handler(on_oom)
    assert malloc(1 << 40) == 0
    own, device = inst.last_error(-1), inst.last_error(0)
    for msg in (own, device):
        assert "out of memory on device 0" in msg and "\nsnapshot: xxx" in msg and msg.endswith("x...")


# ---- npu_pool.install() ------------------------------------------------------------------------

@pytest.mark.parametrize("first", ["npu_pool.install", "npu_pool.installed", "import npu_pool.install"])
def test_npu_pool_install_is_the_module_and_the_call_whatever_is_asked_first(first: str) -> None:
    """docs/devices.md and recorder.md call npu_pool.install.installed() and .current_pool():
    after `import npu_pool; npu_pool.install` the package attribute was the function, and those
    raised AttributeError (after `import npu_pool.install` first, they worked)."""
    ask = f"{first}; import npu_pool" if first.startswith("import") else f"import npu_pool; {first}"
    code = (f"{ask}; m = npu_pool.install; print(m.installed(), m.current_pool is npu_pool.current_pool, "
            "type(m).__name__, callable(m))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert r.returncode == 0 and r.stdout.split() == ["{}", "True", "_CallableModule", "True"], r.stderr[-2000:]


def test_install_without_a_device_says_what_is_missing() -> None:
    with pytest.raises(inst.DeviceUnavailableError) as e:
        npu_pool.install()
    assert "torch_npu is not installed" in str(e.value) and "CPU-only build" in str(e.value)
    with pytest.raises(inst.DeviceUnavailableError, match="device_type='cuda'.*CPU-only"):
        npu_pool.install(device_type="cuda")
    with pytest.raises(inst.DeviceUnavailableError, match="device_type='npu'.*torch_npu"):
        npu_pool.install(device_type="npu")
    with pytest.raises(ValueError, match="device_type"):
        npu_pool.install(device_type="tpu")
    with pytest.raises(ConfigError, match="policy='best'"):
        npu_pool.install(policy="best")


class _Handle:
    """Stands in for torch's allocator object: records what each setter received."""

    def __init__(self, setters: tuple[str, ...]):
        self.got: dict[str, int] = {}
        for name in setters:
            setattr(self, name, lambda ptr, name=name: self.got.__setitem__(name, ptr))


class _CudaPluggable:
    """Stands in for CUDAPluggableAllocator."""

    setters = ("set_init_fn", "set_reset_fn", "set_memory_fraction_fn", "set_base_alloc_fn", "set_record_stream_fn")

    def __init__(self, path: str, alloc: str, free: str):
        self.path, self.names = path, (alloc, free)
        self.handle = _Handle(self.setters)

    def allocator(self) -> _Handle:
        return self.handle


@pytest.fixture
def fake_cuda_torch(monkeypatch: pytest.MonkeyPatch) -> list:
    """torch as a CUDA build with two GPUs and a swappable allocator; returns the swaps made."""
    swaps: list = []
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda.memory, "CUDAPluggableAllocator", _CudaPluggable)
    monkeypatch.setattr(torch.cuda.memory, "change_current_allocator", swaps.append)
    return swaps


def _addr(symbol: str) -> int:
    return int(ffi.cast("uintptr_t", ffi.addressof(so, symbol)))


@pytest.mark.parametrize("cpp", [True, False], ids=["cpp-hooks", "c-hooks-only"])
def test_install_on_cuda_registers_the_hooks_torch_supports(fakes: dict, fake_cuda_torch: list, cpp: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """malloc and free: the C++ hooks (a refused request raises torch.OutOfMemoryError), or,
    when they cannot be built, the core's C entry points with a warning saying what is lost."""
    from npu_pool import cpp_hooks

    v = _vendor(fakes, "cuda")
    if cpp:
        try:
            hooks = cpp_hooks.load("cuda")
        except cpp_hooks.HooksUnavailable as e:
            unavailable(f"the C++ hooks cannot be built here: {e}")
        pools = npu_pool.install(device_type="cuda", fraction=0.5, lib_path=v.path)
    else:
        def unavailable(kind: str) -> None:
            raise cpp_hooks.HooksUnavailable("no C++ compiler (set CXX, or install g++) to build npu_pool's C++ hooks")

        monkeypatch.setattr(cpp_hooks, "load", unavailable)
        with pytest.warns(RuntimeWarning, match="using the C hooks only: an out-of-memory request is not raised"):
            pools = npu_pool.install(device_type="cuda", fraction=0.5, lib_path=v.path)
    assert pools[0].stats()["calls"]["free"] == 0  # creating the context frees nothing (no cudaFree(NULL))
    (alloc,) = fake_cuda_torch
    if cpp:
        assert alloc.path == hooks.path and alloc.names == ("npu_pool_hooks_malloc", "npu_pool_hooks_free")
    else:
        assert alloc.path == inst.core_path() and alloc.names == ("npu_pool_malloc", "npu_pool_free")
    got = alloc.handle.got
    assert sorted(got) == ["set_init_fn", "set_memory_fraction_fn", "set_record_stream_fn", "set_reset_fn"]
    assert got["set_reset_fn"] == _addr("npu_pool_empty_cache")
    assert sorted(pools) == [0, 1] and inst.installed()[1] is pools[1] and inst.current_pool() is pools[0]
    # torch calls the functions by address with these signatures
    loaded = ctypes.CDLL(alloc.path)
    addr = [ctypes.cast(loaded[name], ctypes.c_void_p).value for name in alloc.names]
    malloc_fn = ctypes.CFUNCTYPE(c.c_void_p, c.c_size_t, c.c_int, c.c_void_p)(addr[0])
    free_fn = ctypes.CFUNCTYPE(None, c.c_void_p, c.c_size_t, c.c_int, c.c_void_p)(addr[1])
    p = malloc_fn(3 * MiB, 0, None)
    assert p, inst.last_error(0)
    ctypes.memset(p, 7, 3 * MiB)
    assert pools[0].stats()["limit"] == 128 * MiB  # fraction 0.5 of the fake's 256 MiB
    ctypes.CFUNCTYPE(None, c.c_double, c.c_int)(got["set_memory_fraction_fn"])(0.25, 0)
    assert pools[0].stats()["limit"] == 64 * MiB
    npu_pool.set_fraction(0.75)
    assert pools[0].stats()["limit"] == 192 * MiB
    ctypes.CFUNCTYPE(None, c.c_void_p, c.c_void_p)(got["set_record_stream_fn"])(p, 0x55)  # used on a 2nd stream
    free_fn(p, 3 * MiB, 0, None)
    q = malloc_fn(3 * MiB, 0, None)
    assert pools[0].stats()["stream_waits"] == 1  # its reuse waited for the recorded stream
    free_fn(q, 3 * MiB, 0, None)
    ctypes.CFUNCTYPE(None)(got["set_reset_fn"])()
    assert v.lib.fake_mapped() == 0
    ctypes.CFUNCTYPE(None, c.c_int)(got["set_init_fn"])(2)
    assert npu_pool.install(device_type="cuda", lib_path=v.path) == pools  # again: the same pools
    npu_pool.install(device_type="cuda", fraction=0.5, lib_path=v.path)  # a new cap applies to them
    assert pools[0].stats()["limit"] == 128 * MiB
    with pytest.raises(inst.InstallError, match="already installed"):
        npu_pool.install(device_type="cuda", policy="torch", lib_path=v.path)
    with pytest.raises(inst.InstallError, match="already installed over .*; lib_path='/nonexistent.so' cannot"):
        npu_pool.install(device_type="cuda", lib_path="/nonexistent.so")  # (it was ignored, silently)
    assert npu_pool.install(device_type="cuda") == pools  # none named: the installed one serves


def test_cuda_memory_apis_answer_with_the_pool(fakes: dict, fake_cuda_torch: list,
                                               monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """CUDAPluggableAllocator has no statistics hook: torch.cuda's memory functions are answered
    by the pool (through the names of torch._C they call), with its exact figures."""
    pools = npu_pool.install(device_type="cuda", lib_path=_vendor(fakes, "cuda").path)
    monkeypatch.setattr(torch.cuda.memory, "is_initialized", lambda: True)  # what memory_stats checks
    assert torch.cuda.memory_allocated(0) == 0 and torch.cuda.memory_reserved(0) == 0  # nothing served yet
    ptrs = [malloc(n) for n in (1000, 3 * MiB, 5 * MiB)]
    st = pools[0].stats()
    assert torch.cuda.memory_allocated(0) == st["total"]["allocated"]["current"] > 8 * MiB
    assert torch.cuda.memory_reserved(0) == st["total"]["reserved"]["current"]
    assert torch.cuda.max_memory_allocated(0) == st["total"]["allocated"]["peak"]
    free(ptrs[2])
    assert torch.cuda.max_memory_allocated(0) > torch.cuda.memory_allocated(0)
    torch.cuda.reset_peak_memory_stats(0)
    assert torch.cuda.max_memory_allocated(0) == torch.cuda.memory_allocated(0)
    stats = torch.cuda.memory_stats(0)
    assert stats["num_device_alloc"] == pools[0].stats()["device_mallocs"]
    assert stats["allocation.all.current"] == 2 and stats["requested_bytes.all.current"] == 1000 + 3 * MiB
    assert stats["max_split_size"] == -1  # torch's "no limit"
    assert stats == torch.cuda.memory_stats(0) and "Tot Alloc" in torch.cuda.memory_summary(0)
    torch.cuda.reset_accumulated_memory_stats(0)
    assert torch.cuda.memory_stats(0)["allocated_bytes.all.freed"] == 0
    # non-releasable memory: the free bytes empty_cache cannot return, as torch's (it counted all)
    before, st = torch.cuda.memory_stats(0), pools[0].stats()
    free_bytes = st["total"]["reserved"]["current"] - st["total"]["active"]["current"]
    assert before["inactive_split_bytes.all.current"] == free_bytes - st["releasable"]
    so.npu_pool_empty_cache()  # (torch.cuda.empty_cache calls this hook; a CPU build has no _cuda_emptyCache)
    after = torch.cuda.memory_stats(0)
    assert before["reserved_bytes.all.current"] - after["reserved_bytes.all.current"] == st["releasable"]
    assert after["inactive_split_bytes.all.current"] == before["inactive_split_bytes.all.current"]
    torch.cuda.memory._record_memory_history(max_entries=100)
    q = malloc(MiB)
    snap = torch.cuda.memory._snapshot()
    assert len(snap["device_traces"]) == 2  # one per device torch sees, as torch's (device 1 served nothing)
    actions = [e["action"] for e in snap["device_traces"][0]]
    assert actions[-1] == "alloc" and snap["device_traces"][0][-1]["addr"] == q
    assert sum(s["total_size"] for s in snap["segments"]) == pools[0].stats()["total"]["reserved"]["current"]
    torch.cuda.memory._dump_snapshot(str(tmp_path / "s.pickle"))
    from npu_pool.trace.snapshot import load_snapshot

    (t,) = load_snapshot(tmp_path / "s.pickle")  # our own importer reads it back
    assert len(t) > 0
    for p in (ptrs[0], ptrs[1], q):
        free(p)
    inst._reset()
    assert not hasattr(torch._C, "_cuda_memoryStats") or torch._C._cuda_memoryStats is not torch_memory._memory_stats


def test_compaction_asked_in_the_environment_serves_what_pinned_pages_refused(fakes: dict, fake_cuda_torch: list,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """NPU_POOL_COMPACT=1: every device's context compacts from its first request (tests/test_compaction.py
    has the rule); npu_pool.set_compaction turns it off and on again at run time, and npu_pool.compact()
    compacts with it off."""
    monkeypatch.setenv("NPU_POOL_COMPACT", "1")
    npu_pool.install(device_type="cuda", lib_path=_vendor(fakes, "cuda").path)

    def pinned(held: list[int]) -> list[int]:
        """``held`` freed, then ten 25 MiB blocks on the 256 MiB device, every other one freed."""
        for x in held:
            free(x)
        so.npu_pool_empty_cache()
        ptrs = [malloc(25 * MiB) for _ in range(10)]
        assert all(ptrs)
        for x in ptrs[::2]:
            free(x)
        so.npu_pool_empty_cache()
        return ptrs[1::2]

    live = pinned([])
    big = malloc(75 * MiB)
    assert big and npu_pool.installed()[0].stats()["compactions"] > 0
    npu_pool.set_compaction(False)
    live = pinned([*live, big])
    assert malloc(75 * MiB) == 0  # the pinned pages refuse it without compaction
    npu_pool.set_compaction(True, device=0)
    big = malloc(75 * MiB)
    assert big != 0
    with pytest.raises(InvalidArgumentError, match="no npu_pool allocator installed on device 5"):
        npu_pool.set_compaction(True, device=5)
    npu_pool.set_compaction(False)
    live = pinned([*live, big])
    assert malloc(75 * MiB) == 0
    # compact() at a moment the caller chooses, the setting off: every device, a device that
    # served nothing giving back nothing (and getting no context for it)
    assert npu_pool.compact() > 0 and npu_pool.installed()[1].serving is False
    assert npu_pool.compact(device=0) == 0  # nothing left to give back
    assert malloc(75 * MiB) != 0
    inst._reset()


def test_what_frameworks_ask_the_installed_pool_besides_statistics(fakes: dict, fake_cuda_torch: list,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """From a review of torch's memory APIs under the installed pool: torch.cuda's
    get_per_process_memory_fraction, the older _record_memory_history(True,
    trace_alloc_max_entries=N) form and _cuda_attach_out_of_memory_observer (MindSpeed's
    --record-memory-history uses both) raised the pluggable allocator's "does not yet support"."""
    pools = npu_pool.install(device_type="cuda", lib_path=_vendor(fakes, "cuda").path)
    monkeypatch.setattr(torch.cuda.memory, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_lazy_init", lambda: None)
    assert torch._C._cuda_getMemoryFraction(0) == 1.0
    npu_pool.set_fraction(0.25, device=1)  # before device 1's first request: said as it will be
    assert torch._C._cuda_getMemoryFraction(1) == 0.25
    pools[0].set_fraction(0.5)
    assert torch.cuda.memory.get_per_process_memory_fraction(0) == 0.5
    torch.cuda.memory._record_memory_history(True, trace_alloc_max_entries=3, trace_alloc_record_context=True)
    ptrs = [malloc(n * MiB) for n in (1, 2, 3, 4)]
    assert len(pools[0].history()) == 3  # the bound it asked for
    seen: list[tuple] = []
    torch._C._cuda_attach_out_of_memory_observer(lambda *args: seen.append(args))
    torch._C._cuda_attach_out_of_memory_observer(lambda *args: 1 / 0)  # one that raises: the rest still run
    with pytest.raises(TypeError, match="callable"):
        torch._C._cuda_attach_out_of_memory_observer(3)
    assert malloc(1 << 40) == 0  # past the cap: the request fails, the observers hear of it
    st = pools[0].stats()
    assert seen == [(0, 1 << 40, st["limit"], seen[0][3])] and 0 <= seen[0][3] <= st["device_total"]
    for p in ptrs:
        free(p)
    torch.cuda.memory._record_memory_history(False)
    inst._reset()
    assert not hasattr(torch._C, "_cuda_getMemoryFraction") or torch._C._cuda_getMemoryFraction is not \
        torch_memory._memory_fraction


def test_graph_capture_and_private_pools_are_refused(fakes: dict, fake_cuda_torch: list) -> None:
    """torch's CUDAPluggableAllocator does nothing on beginAllocateToPool without a hook, so a graph
    captured under npu_pool had its memory handed to other tensors while it replayed (measured on an
    H100, docs/gpu.md): capture and private pools raise npu_pool's error instead, and the originals
    come back with the installation."""
    from npu_pool.torch_memory import PrivatePoolError

    graphs, memory = torch.cuda.graphs, torch.cuda.memory

    def state() -> tuple:
        return (graphs.CUDAGraph.__dict__.get("capture_begin"), graphs.graph.__dict__["__init__"],
                torch._C._cuda_beginAllocateCurrentThreadToPool, memory._cuda_beginAllocateCurrentThreadToPool)

    before = state()
    npu_pool.install(device_type="cuda", lib_path=_vendor(fakes, "cuda").path)
    pool = type("P", (), {"id": (1, 0)})()
    calls = (lambda: torch.cuda.graph(None), lambda: graphs.CUDAGraph.capture_begin(object()),
             lambda: torch._C._cuda_beginAllocateCurrentThreadToPool(0, (1, 0)),
             lambda: torch._C._cuda_beginAllocateToPool(0, (1, 0)),
             lambda: memory.use_mem_pool(pool, device=0).__enter__())  # (torch.cuda.memory binds the name itself)
    for call in calls:
        with pytest.raises(PrivatePoolError, match=r"npu_pool: graph capture and private memory pools \(torch.cuda.graph"
                                                   r".*handed to other tensors while the graph replays"):
            call()
    assert isinstance(PrivatePoolError("x"), RuntimeError)  # what torch's own refusals raise
    inst._reset()
    assert state() == before


def test_a_graph_class_that_takes_no_attribute_leaves_the_install_working(fakes: dict, fake_cuda_torch: list,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A C base class that refuses attributes (a build of torch whose pybind classes do) is left as it
    is: install() works and the Python paths above it still refuse."""
    from npu_pool.torch_memory import PrivatePoolError

    class Frozen(type):
        def __setattr__(cls, name: str, value: object) -> None:
            raise TypeError("immutable type")

    class Base(metaclass=Frozen):
        def capture_begin(self) -> str:
            return "began"

    monkeypatch.setattr(torch._C, "_CUDAGraph", Base, raising=False)
    npu_pool.install(device_type="cuda", lib_path=_vendor(fakes, "cuda").path)
    assert Base().capture_begin() == "began"
    with pytest.raises(PrivatePoolError):
        torch.cuda.graph(None)
    inst._reset()


def test_record_memory_history_keeps_what_oom_snapshots_need(fakes: dict, fake_cuda_torch: list,
                                                              monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """With OOM snapshots on the pool keeps HISTORY_WHEN_ENABLED events; a profiler stopping
    (_record_memory_history(enabled=None)) cut that to the default, max_entries=0 to none, and the
    next snapshot, said written, held no event (found by a review of the torch_npu path)."""
    from npu_pool import oom
    from npu_pool.vocab import HISTORY_DEFAULT

    monkeypatch.setenv(oom.ENV, str(tmp_path / "snaps"))
    pools = npu_pool.install(device_type="cuda", lib_path=_vendor(fakes, "cuda").path)
    assert oom.HISTORY_WHEN_ENABLED > HISTORY_DEFAULT + 100
    for stop in (dict(enabled=None), dict(max_entries=0)):
        torch.cuda.memory._record_memory_history(**stop)
        for _ in range((HISTORY_DEFAULT + 100) // 2):
            free(malloc(4096))
        assert len(pools[0].history()) >= HISTORY_DEFAULT + 100
    inst._reset()


def test_install_with_a_library_that_cannot_load_leaves_torch_alone(fakes: dict, fake_cuda_torch: list) -> None:
    """The vendor library is loaded when the pool is configured: a wrong lib_path is an
    InstallError naming it before torch's allocator is swapped (before: install returned, and
    every allocation then failed on an allocator torch could not drop)."""
    for bad in ("/nonexistent/libcudart.so", str(ROOT)):  # missing, a directory
        with pytest.raises(inst.InstallError, match="could not be configured: .*" + re.escape(bad)):
            npu_pool.install(device_type="cuda", lib_path=bad)
        assert fake_cuda_torch == [] and inst.installed() == {}
    npu_pool.install(device_type="cuda", lib_path=_vendor(fakes, "cuda").path)  # nothing was left half-done
    assert len(fake_cuda_torch) == 1


def test_a_repeated_install_keeps_the_cap_set_since(fakes: dict, fake_cuda_torch: list,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """install() again (mindspeed_patch and a script both calling it) re-applies a fraction given
    to it, not NPU_POOL_FRACTION: a cap set at run time stays (before: silently reset)."""
    monkeypatch.setenv("NPU_POOL_FRACTION", "0.5")
    v = _vendor(fakes, "cuda")
    pools = npu_pool.install(device_type="cuda", lib_path=v.path)
    free(malloc(MiB))  # torch's first request makes device 0's context
    assert pools[0].stats()["limit"] == 128 * MiB
    npu_pool.set_fraction(0.25)  # as torch's set_per_process_memory_fraction does through its hook
    npu_pool.install(device_type="cuda", lib_path=v.path)
    assert pools[0].stats()["limit"] == 64 * MiB
    npu_pool.install(device_type="cuda", fraction=0.75, lib_path=v.path)
    assert pools[0].stats()["limit"] == 192 * MiB
    # another device type than the installed one is that, not a missing device (DeviceUnavailableError before)
    with pytest.raises(inst.InstallError, match=r"already installed \(cuda, policy npu_pool\)") as e:
        npu_pool.install(device_type="npu")
    assert "MEMORY_FRAGMENTATION installed it" not in str(e.value)
    monkeypatch.setenv("MEMORY_FRAGMENTATION", "1")  # as the start-up hook had installed it: say so, and what to set
    with pytest.raises(inst.InstallError, match="MEMORY_FRAGMENTATION installed it at start-up: choose its policy "
                                                "and cap with NPU_POOL_POLICY and NPU_POOL_FRACTION"):
        npu_pool.install(device_type="cuda", policy="torch", lib_path=v.path)


def test_a_fraction_a_device_refuses_is_set_on_none(fakes: dict, fake_cuda_torch: list) -> None:
    """A cap one device refuses (below its smallest block) was kept pending on a device that had
    not allocated yet, which could then allocate nothing, while the call raised: all or none."""
    v = _vendor(fakes, "cuda")
    pools = npu_pool.install(device_type="cuda", lib_path=v.path)
    free(malloc(MiB, 1), 1)  # device 1 serves memory; device 0 has not allocated yet
    npu_pool.set_fraction(0.5, device=1)
    with pytest.raises(PoolError, match="less than the smallest block"):
        npu_pool.set_fraction(1e-300)
    assert pools[1].stats()["fraction"] == 0.5  # as it was
    ptr = malloc(MiB, 0)
    assert ptr and pools[0].stats()["limit"] == 256 * MiB  # no cap came with it
    free(ptr, 0)
    with pytest.raises(ConfigError, match="fraction=1e-300"):  # install() names a bad fraction so
        npu_pool.install(device_type="cuda", fraction=1e-300, lib_path=v.path)
    assert [p.stats()["fraction"] for p in pools.values()] == [1.0, 0.5]


def test_two_threads_setting_the_fraction_leave_every_device_at_one_of_them(fakes: dict, fake_cuda_torch: list) -> None:
    """set_fraction from two threads at once: every device ends at one call's cap (the calls take
    the devices one after the other). Before, they interleaved device by device: both returned and
    the devices kept different caps (27-47 of 300 rounds under torch_npu; a review of the Python
    layer under threads, a helper)."""
    import sys
    import threading

    v = _vendor(fakes, "cuda")
    pools = npu_pool.install(device_type="cuda", lib_path=v.path)
    ptrs = [malloc(MiB, d) for d in (0, 1)]  # both devices serve memory
    old, mixed = sys.getswitchinterval(), 0
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(200):
            bar = threading.Barrier(2)

            def call(f: float) -> None:
                bar.wait()
                npu_pool.set_fraction(f)

            ts = [threading.Thread(target=call, args=(f,)) for f in (0.5, 0.75)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            mixed += len({p.stats()["fraction"] for p in pools.values()}) > 1
    finally:
        sys.setswitchinterval(old)
    for d, ptr in enumerate(ptrs):
        free(ptr, d)
    assert mixed == 0


def test_reading_a_device_that_served_nothing_makes_no_context(fakes: dict, fake_cuda_torch: list) -> None:
    """Every reading of an installed pool answers for a device that served nothing without making
    its context (on a device: a runtime context on every device of every rank); stats() did, the
    others made one."""
    from npu_pool.snapshot import pool_snapshot

    v = _vendor(fakes, "cuda")
    pools = npu_pool.install(device_type="cuda", lib_path=v.path)
    free(malloc(MiB, 0), 0)
    idle = pools[1]
    assert (idle.blocks(), idle.mapped_ranges(), idle.history(), idle.tags()) == ([], [], [], {})
    assert idle.view() == (idle.stats(), [], [], [])
    idle.check(), idle.empty_cache(), idle.forget(), idle.set_history(16)
    with pytest.raises(PoolError, match="not planned"):
        idle.plan_counts()
    with pytest.raises(npu_pool.UnknownPointerError, match="never allocated"):
        idle.block_size(0x1000)
    with pytest.raises(npu_pool.InvalidArgumentError, match="no tag 'x'"):
        idle.pause("x")
    for call in (lambda: idle.block_size("abc"), lambda: idle.pause("x", backup="yes")):
        with pytest.raises(npu_pool.InvalidArgumentError):  # (the argument's error first: a bare ValueError before)
            call()
    snap = pool_snapshot(npu_pool.installed())
    assert len(snap["device_traces"]) == 2 and snap["device_traces"][1] == []
    assert [p.serving for p in pools.values()] == [True, False]
    assert malloc(MiB, 1)  # and the device works once it is used


def test_a_library_path_that_is_no_path_is_refused(fakes: dict, fake_cuda_torch: list) -> None:
    for bad in (5, "a\0b", b"/lib.so", "", ":"):  # ("", ":": loaded the default library, silently)
        with pytest.raises(npu_pool.InvalidArgumentError, match="lib_path must be a path"):
            npu_pool.install(device_type="cuda", lib_path=bad)
    assert not fake_cuda_torch and not npu_pool.installed()  # torch untouched


def test_settings_install_would_ignore_are_refused_or_named(tmp_path: Path, fakes: dict, fake_cuda_torch: list,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    plan = tmp_path / "p.plan"
    plan.write_bytes(b"x")
    monkeypatch.setenv("NPU_POOL_PLAN", str(plan))  # without the planned policy: ignored before
    with pytest.raises(ConfigError, match="which only the planned policy serves, but the policy is npu_pool: set "
                       "NPU_POOL_POLICY=planned, or unset NPU_POOL_PLAN"):
        npu_pool.install(device_type="cuda", lib_path=fakes["cuda"])
    monkeypatch.delenv("NPU_POOL_PLAN")
    # named in the YAML file, which the environment overrides for the policy: the message names the file's key
    conf = tmp_path / "pool.yaml"
    conf.write_text(f"npu_pool_policy: planned\nnpu_pool_plan: {plan}\n")
    monkeypatch.setenv("NPU_POOL_CONFIG", str(conf))
    monkeypatch.setenv("NPU_POOL_POLICY", "npu_pool")
    with pytest.raises(ConfigError, match=f"or remove npu_pool_plan in {conf}$"):
        npu_pool.install(device_type="cuda", lib_path=fakes["cuda"])
    monkeypatch.delenv("NPU_POOL_CONFIG")
    monkeypatch.delenv("NPU_POOL_POLICY")
    monkeypatch.setenv("NPU_POOL_OOM_SNAPSHOT", str(plan))  # a file: said at the first OOM before, its snapshot lost
    with pytest.raises(ConfigError, match="NPU_POOL_OOM_SNAPSHOT=.* is not a directory"):
        npu_pool.install(device_type="cuda", lib_path=fakes["cuda"])
    assert fake_cuda_torch == []
    monkeypatch.delenv("NPU_POOL_OOM_SNAPSHOT")
    monkeypatch.setenv("NPU_POOL_FRACTON", "0.5")  # a typo: no cap, silently, before
    with pytest.warns(RuntimeWarning, match="NPU_POOL_FRACTON is not a variable npu_pool reads .did you mean "
                                            "NPU_POOL_FRACTION"):
        npu_pool.install(device_type="cuda", lib_path=fakes["cuda"])


def test_every_variable_a_module_reads_is_known() -> None:
    """config.KNOWN_VARIABLES spells out the names other modules define (oom and mindspeed_patch
    sit below or beside config and keep their own constants): a renamed one would be warned about."""
    from mindspeed_patch import megatron
    from npu_pool import cpp_hooks, oom

    for name in (cpp_hooks.CACHE_ENV, oom.ENV, megatron.LOG_EVERY, megatron.REPORT_DIR, config.FRACTION,
                 config.POLICY, config.PLAN, config.CONFIG_FILE):
        assert name in config.KNOWN_VARIABLES, name


def test_every_variable_the_repository_names_is_known() -> None:
    """Every NPU_POOL_* name in the package, the patch, the benchmarks and the scripts is one
    install() knows: benchmarks/cuda_call_costs.py's NPU_POOL_CUDART was warned about as a typo."""
    import re

    files = [*ROOT.glob("npu_pool/**/*.py"), *ROOT.glob("npu_pool/csrc/*.[ch]"), *ROOT.glob("mindspeed_patch/*.py"),
             *ROOT.glob("benchmarks/*.py"), *ROOT.glob("benchmarks/*.sh"), ROOT / "run", ROOT / ".ci" / "run",
             ROOT / "npu_pool_startup.py", ROOT / "setup.py"]
    named = {m for f in files for m in re.findall(r"\bNPU_POOL_[A-Z][A-Z0-9_]*", f.read_text())}
    named.discard("NPU_POOL_H")  # (the C header's include guard)
    assert "NPU_POOL_FRACTION" in named and not named - set(config.KNOWN_VARIABLES), named - set(config.KNOWN_VARIABLES)


def test_unknown_variables_and_output_folders() -> None:
    env = {"NPU_POOL_POILCY": "torch", "NPU_POOL_FRACTION": "0.5", "NPU_POOL_SHARED": "/x", "NPU_POOL_ZZZ": "1"}
    lines = config.unknown_variables(env)
    assert len(lines) == 2 and "did you mean NPU_POOL_POLICY" in lines[0] and lines[1].startswith("NPU_POOL_ZZZ is not")
    assert "did you mean" not in lines[1]
    assert config.parse_output_dir(str(ROOT), "X") == str(ROOT)
    assert config.parse_output_dir(str(ROOT / "not-yet"), "X") == str(ROOT / "not-yet")  # made when first written
    assert not (ROOT / "not-yet").exists() and not list(ROOT.glob(".npu_pool-check-*"))
    # a folder this process cannot make or write is found now, not at exit when the report is due
    for bad, why in (("/proc/npu_pool-nowhere", "No such file or directory"), ("/tmp/" + "x" * 300, "File name too long"),
                     (str(ROOT / "setup.py" / "sub"), "Not a directory")):
        with pytest.raises(config.ConfigError, match=f"cannot be written \\({why} in"):
            config.parse_output_dir(bad, "NPU_POOL_REPORT_DIR")
    # torch_npu's OOM_SNAPSHOT_PATH (the working directory by default) names an optional folder: a warning
    with pytest.warns(RuntimeWarning, match="OOM_SNAPSHOT_PATH=.*cannot be written.*nothing will be written there"):
        assert config.parse_output_dir("/proc/npu_pool-nowhere", "OOM_SNAPSHOT_PATH", unwritable_warns=True)
    with pytest.raises(ConfigError, match="X=.*setup.py.* is not a directory"):
        config.parse_output_dir(str(ROOT / "setup.py"), "X")
    with pytest.warns(RuntimeWarning, match="OOM_SNAPSHOT_PATH=.*setup.py.* is not a directory.*nothing will be"):
        assert config.parse_output_dir(str(ROOT / "setup.py"), "OOM_SNAPSHOT_PATH", unwritable_warns=True)


def test_install_too_late_says_what_to_move(fakes: dict, fake_cuda_torch: list,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(inst.TooLateError, match="before the model is built and before any tensor"):
        npu_pool.install(device_type="cuda", lib_path=fakes["cuda"])

    def refuse(allocator: Any) -> None:
        raise RuntimeError("Can't swap an already initialized allocator")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda.memory, "change_current_allocator", refuse)
    with pytest.raises(inst.TooLateError, match="Set MEMORY_FRAGMENTATION=1 in the environment of the launch"):
        npu_pool.install(device_type="cuda", lib_path=fakes["cuda"])
    assert not inst.installed()


def test_install_is_callable_as_the_package_attribute() -> None:
    import npu_pool.install as module  # binds the submodule over the lazily exported function

    assert callable(npu_pool.install) and callable(module)
    with pytest.raises(inst.DeviceUnavailableError):
        npu_pool.install()


# ---- import mindspeed_patch ----------------------------------------------------------------------

def _import_patch(**env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("MEMORY_FRAGMENTATION", "NPU_POOL_"))}
    full.update(env, PYTHONPATH=str(ROOT))
    code = "import sys, mindspeed_patch; print('torch' in sys.modules)"
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=60)


def test_mindspeed_patch_warns_without_a_device() -> None:
    r = _import_patch(MEMORY_FRAGMENTATION="1")
    assert r.returncode == 0, r.stderr
    assert "RuntimeWarning: MEMORY_FRAGMENTATION=1, but npu_pool was not installed" in r.stderr
    assert "torch_npu is not installed" in r.stderr and "CPU-only" in r.stderr


def test_mindspeed_patch_is_quiet_when_off_and_rejects_bad_values() -> None:
    r = _import_patch(MEMORY_FRAGMENTATION="0")
    assert r.returncode == 0 and r.stderr == "" and r.stdout.strip() == "False"  # torch not even imported
    # a user's mistake is one line and exit status 2, not a traceback (before: a ConfigError's)
    for env, words in [({"NPU_POOL_POLICY": "fast"}, "NPU_POOL_POLICY='fast' is not valid: use one of torch, npu_pool, "
                        "expandable"),
                       ({"NPU_POOL_LOG_EVERY": "-5"}, "NPU_POOL_LOG_EVERY='-5' is not valid")]:
        r = _import_patch(MEMORY_FRAGMENTATION="1", **env)
        assert (r.returncode, r.stdout) == (2, "") and "Traceback" not in r.stderr, r.stderr
        (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("npu_pool: ")]
        assert words in line, r.stderr
    # called by hand it raises, for the caller to handle
    r = subprocess.run([sys.executable, "-c", "import os; os.environ['MEMORY_FRAGMENTATION'] = '0'; "
                        "import mindspeed_patch; os.environ.update(MEMORY_FRAGMENTATION='1', NPU_POOL_POLICY='fast')\n"
                        "try:\n    mindspeed_patch.install_memory_pool()\nexcept Exception as e:\n"
                        "    print(type(e).__name__)"],
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout.strip()) == (0, "ConfigError"), r.stderr


@pytest.mark.parametrize("early", [True, False])
def test_a_fraction_set_before_the_first_request_caps_the_torch_model_as_one_set_after(fakes: dict,
                                                                                         early: bool) -> None:
    """torch's allocator caps itself once any memory fraction is set, 1.0 included, and asks the
    device no more; a fraction given to the hooks before the device's first request was taken as
    none set (two refused cudaMalloc for a request past the device)."""
    v = _vendor(fakes, "cuda")
    _configure(v, "torch")
    if early:
        so.npu_pool_set_fraction(0, 1.0)
    assert malloc(MiB)  # the device's context is made here
    if not early:
        so.npu_pool_set_fraction(0, 1.0)
    before = v.calls("malloc")
    assert malloc(1 << 30) == 0  # past the 256 MiB fake device
    assert v.calls("malloc") == before  # refused by the pool itself, no device call


def test_run_refuses_to_install_into_the_systems_python(tmp_path: Path) -> None:
    """`./run demo` outside a virtual environment installed torch and the package into whatever
    python3 was first on the PATH, the system's included (a newcomer's walk-through): it refuses
    the Python its distribution manages (PEP 668's EXTERNALLY-MANAGED), before installing anything."""
    system = Path("/usr/bin/python3")
    probe = "import os, sys, sysconfig; sys.exit(not (sys.prefix == sys.base_prefix and " \
            "os.path.exists(os.path.join(sysconfig.get_path('stdlib'), 'EXTERNALLY-MANAGED'))))"
    if not system.exists() or subprocess.run([str(system), "-c", probe]).returncode != 0:
        pytest.skip("no system Python its distribution manages (PEP 668) on this machine")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHON")}
    r = subprocess.run(["bash", str(ROOT / "run"), "demo"], env={**env, "PYTHON": str(system)}, cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "is the system's Python: installing here would change the machine's packages" \
        in r.stderr, r.stderr[-2000:]
    assert "python3 -m venv .venv" in r.stderr and "installing" not in r.stderr.replace("installing here", "")


def test_a_late_install_with_the_switch_set_says_its_start_up_hook_never_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    """MEMORY_FRAGMENTATION=1 set, and yet install() comes too late: the start-up hook is not in this Python
    (a PYTHONPATH checkout, `python -S`). The message said to set the variable that was set."""
    from npu_pool.install import _too_late

    monkeypatch.setenv("MEMORY_FRAGMENTATION", "1")
    monkeypatch.delitem(sys.modules, "npu_pool_startup", raising=False)
    msg = str(_too_late("npu"))
    assert "start-up hook did not run" in msg and "set after Python started" in msg  # (a script's own os.environ)
    assert "Set MEMORY_FRAGMENTATION=1" not in msg
    monkeypatch.delenv("MEMORY_FRAGMENTATION")
    assert "Set MEMORY_FRAGMENTATION=1" in str(_too_late("npu"))
