"""The acl and cuda backends, driven through Pool(backend=..., lib_path=fake) over the
host-memory fakes in tests/fake_vendor (built here with the system C compiler)."""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from npu_pool import oom
from npu_pool.pool import BackendError, OutOfMemoryError, Pool, PoolError
from conftest import unavailable

MiB = 1 << 20
PAGE = 2 * MiB
FAKES = Path(__file__).parent / "fake_vendor"
NP_ERR_BACKEND = 5
NP_ERR_INVALID = 2  # (npu_pool.h)

# vendor symbol for each operation, and the error codes the tests inject
NAMES = {
    "acl": {"malloc": "aclrtMalloc", "free": "aclrtFree", "create": "aclrtMallocPhysical",
            "map": "aclrtMapMem", "unmap": "aclrtUnmapMem", "sync": "aclrtSynchronizeDevice",
            "reserve": "aclrtReserveMemAddress", "release": "aclrtFreePhysical",
            "release_range": "aclrtReleaseMemAddress",
            "wait": "aclrtStreamWaitEvent", "event_destroy": "aclrtDestroyEvent", "internal": 507899,
            "internal_name": "ACL_ERROR_RT_DRV_INTERNAL_ERROR", "oom_name": "207001"},
    "cuda": {"malloc": "cudaMalloc", "free": "cudaFree", "create": "cuMemCreate", "map": "cuMemMap",
             "unmap": "cuMemUnmap", "sync": "cudaDeviceSynchronize", "reserve": "cuMemAddressReserve",
             "release": "cuMemRelease", "release_range": "cuMemAddressFree", "access": "cuMemSetAccess",
             "wait": "cudaStreamWaitEvent", "event_destroy": "cudaEventDestroy", "internal": 999,
             "internal_name": "CUDA_ERROR_UNKNOWN", "oom_name": "CUDA_ERROR_OUT_OF_MEMORY"},
}


def _compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


@pytest.fixture(scope="session")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], str]:
    """{(vendor, variant): path} for variants full, novmm (no VMM symbols), nofree (no free symbol),
    oldevents (ACL: no aclrtCreateEventExWithFlag, as before CANN 8)."""
    cc = _compiler()
    if cc is None:
        unavailable("no C compiler to build the fake vendor libraries")
    out = tmp_path_factory.mktemp("fakes")
    flags = {"full": [], "novmm": ["-DFAKE_NO_VMM"], "nofree": ["-DFAKE_OMIT_FREE"], "oldevents": ["-DFAKE_NO_EVENT_EX"]}
    paths = {}
    for vendor in ("acl", "cuda"):
        for variant, extra in flags.items():
            so = out / f"libfake_{vendor}_{variant}.so"
            subprocess.run([cc, "-shared", "-fPIC", "-O1", *extra, "-o", str(so), str(FAKES / f"fake_{vendor}.c"),
                            "-lpthread"], check=True, capture_output=True)
            paths[(vendor, variant)] = str(so)
    return paths


@dataclass
class Vendor:
    """One fake vendor library: its backend name, path and control functions."""

    backend: str
    path: str
    lib: ctypes.CDLL

    def __post_init__(self) -> None:
        lib = self.lib
        lib.fake_set_capacity.argtypes = lib.fake_set_used.argtypes = [ctypes.c_ulonglong]
        lib.fake_fail.argtypes = [ctypes.c_char_p, ctypes.c_long, ctypes.c_long, ctypes.c_int]
        lib.fake_calls.argtypes = [ctypes.c_char_p]
        lib.fake_calls.restype = ctypes.c_long
        lib.fake_used.restype = lib.fake_mapped.restype = ctypes.c_ulonglong
        lib.fake_live.restype = ctypes.c_long
        lib.fake_set_busy.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.fake_reset()

    @property
    def pad(self) -> int:
        """Bytes to ask for less so that a request fills whole pages: the ACL backend rounds every
        request up to 32 bytes and adds 32 (the vendor's rule), CUDA adds nothing."""
        return 64 if self.backend == "acl" else 0

    def name(self, op: str) -> str:
        return NAMES[self.backend][op]

    def fail(self, op: str, skip: int = 0, count: int = 1, code: int | None = None) -> None:
        code = NAMES[self.backend]["internal"] if code is None else code
        self.lib.fake_fail(self.name(op).encode(), skip, count, code)

    def calls(self, op: str) -> int:
        return self.lib.fake_calls(self.name(op).encode())

    def pool(self, policy: str = "npu_pool", **kw: object) -> Pool:
        return Pool(policy, backend=self.backend, lib_path=self.path, **kw)


def _vendor(builds: dict, backend: str, variant: str = "full", capacity: int = 256 * MiB) -> Vendor:
    v = Vendor(backend, builds[(backend, variant)], ctypes.CDLL(builds[(backend, variant)]))
    v.lib.fake_set_capacity(capacity)
    return v


@pytest.fixture(params=["acl", "cuda"])
def vendor(request: pytest.FixtureRequest, builds: dict) -> Vendor:
    return _vendor(builds, request.param)


def _fill(addr: int, size: int, byte: int) -> None:
    ctypes.memset(addr, byte, size)


def _holds(addr: int, size: int, byte: int) -> bool:
    return ctypes.string_at(addr, size) == bytes([byte]) * size


def test_load_reports_device_memory_and_vmm(vendor: Vendor) -> None:
    with vendor.pool(fraction=0.5) as p:
        st = p.stats()
        assert st["device_total"] == 256 * MiB
        assert st["limit"] == 128 * MiB
        assert st["vmm"] is True


def test_malloc_free_patterns_on_device_memory(vendor: Vendor) -> None:
    with vendor.pool() as p:
        sizes = [100, 4096, 3 * MiB + 7, 513, 9 * MiB, 64]
        ptrs = [p.malloc(s) for s in sizes]
        for i, (a, s) in enumerate(zip(ptrs, sizes)):
            _fill(a, s, i + 1)
        for i, (a, s) in enumerate(zip(ptrs, sizes)):
            assert _holds(a, s, i + 1)
        for a in ptrs[::2]:
            p.free(a)
        more = p.malloc(2 * MiB)
        _fill(more, 2 * MiB, 0xEE)
        for i, (a, s) in list(enumerate(zip(ptrs, sizes)))[1::2]:
            assert _holds(a, s, i + 1)
        p.check()
        assert vendor.lib.fake_mapped() == p.stats()["total"]["reserved"]["current"]
    assert vendor.lib.fake_used() == 0 and vendor.lib.fake_live() == 0


def test_empty_cache_returns_only_whole_free_chunks(vendor: Vendor) -> None:
    with vendor.pool() as p:
        a = p.malloc(5 * MiB - vendor.pad)  # the first growth: one chunk of 20 MiB (one create, one map)
        b = p.malloc(3 * MiB - vendor.pad)  # in the same chunk
        _fill(b, 3 * MiB, 0x5A)
        assert vendor.lib.fake_mapped() == 20 * MiB and vendor.calls("map") == 1
        p.free(a)
        unmaps = vendor.calls("unmap")
        p.empty_cache()
        # the chunk still holds b, and no vendor unmaps part of a mapping: nothing goes back
        assert vendor.calls("unmap") - unmaps == 0
        assert vendor.lib.fake_mapped() == 20 * MiB == p.stats()["total"]["reserved"]["current"]
        assert _holds(b, 3 * MiB, 0x5A)
        p.free(b)
        p.empty_cache()  # now the whole chunk is free: one unmap
        assert vendor.calls("unmap") - unmaps == 1
        assert vendor.lib.fake_mapped() == 0 and p.stats()["total"]["reserved"]["current"] == 0
        assert vendor.calls("sync") > 0  # memory goes back only after a device synchronisation
        p.check()


def test_device_oom_is_a_clean_out_of_memory_error(vendor: Vendor) -> None:
    with vendor.pool() as p:
        keep = p.malloc(8 * MiB)
        vendor.lib.fake_set_used(240 * MiB - vendor.lib.fake_used())  # another process holds most of the device
        with pytest.raises(OutOfMemoryError) as e:
            p.malloc(32 * MiB)
        msg = str(e.value)
        assert "out of memory on device 0" in msg and NAMES[vendor.backend]["oom_name"] in msg
        assert p.stats()["ooms"] == 1
        # the cause named is the device, not the pool's layout: 16 MiB free, the rest held elsewhere
        reserved = p.stats()["total"]["reserved"]["current"]
        outside = 256 * MiB - 16 * MiB - reserved
        assert "the device refused memory the cap allows: it has 16.00 MiB free" in msg, msg
        assert f"{outside / MiB:.2f} MiB of it is held outside this pool" in msg and "fragmentation" not in msg
        # its largest free block counts the cap's room, which the device did not give: said so
        largest = p.stats()["largest_free"]
        assert largest > reserved - p.stats()["total"]["allocated"]["current"]
        assert "(address space the cap allows, not memory the device gave)" in msg, msg
        x = oom.explain(p)
        assert (x.kind, x.room, x.held_outside) == ("device", 16 * MiB, outside)
        assert "nvidia-smi" in x.suggestions[0] and "16.00 MiB free" in x.summary()
        p.check()
        vendor.lib.fake_set_used(0)
        p.free(p.malloc(32 * MiB))  # the pool recovers once the device has room
        p.free(keep)


@pytest.mark.parametrize("policy", ["torch", "expandable", "planned"])
def test_every_policy_names_a_device_that_refuses(vendor: Vendor, policy: str) -> None:
    """The device refusing what the cap allows is "device" whichever policy asked (the torch
    model's segment malloc, the expandable model's pages, the planned fallback's chunks)."""
    with vendor.pool(policy) as p:
        keep = p.malloc(8 * MiB)
        vendor.lib.fake_set_used(240 * MiB - vendor.lib.fake_used())
        with pytest.raises(OutOfMemoryError, match="the device refused memory the cap allows: it has 16.00 MiB free") as e:
            p.malloc(32 * MiB)
        assert oom.explain(p).kind == "device"
        st = p.stats()  # a largest free block within what the pool holds free is memory it has: no remark
        cached = st["total"]["reserved"]["current"] - st["total"]["allocated"]["current"]
        assert ("not memory the device gave" in str(e.value)) == (st["largest_free"] > cached), str(e.value)
        p.check()
        vendor.lib.fake_set_used(0)
        p.free(keep)


def test_a_granule_the_device_cannot_give_is_not_a_failure(vendor: Vendor) -> None:
    """Far from the cap the arena grows by a 20 MiB chunk; a device with less than that free
    (other processes hold the rest) still serves a request that fits: its own pages."""
    with vendor.pool() as p:
        keep = p.malloc(20 * MiB - vendor.pad)  # the first chunk, whole
        assert vendor.lib.fake_mapped() == 20 * MiB
        vendor.lib.fake_set_used(256 * MiB - 10 * MiB - vendor.lib.fake_used())
        a = p.malloc(2 * MiB - vendor.pad)  # a growth the device cannot give whole: the block's page
        _fill(a, 2 * MiB - vendor.pad, 5)
        assert p.stats()["total"]["reserved"]["current"] == vendor.lib.fake_mapped() <= 256 * MiB
        p.check()
        vendor.lib.fake_set_used(0)
        p.free(a)
        p.free(keep)


def test_a_device_that_does_not_say_what_it_has_free(builds: dict, tmp_path) -> None:
    """... and the OOM snapshot's .json writes the free bytes it did not say as null, not 2^64-1."""
    v = _vendor(builds, "cuda")
    with v.pool() as p:
        p.malloc(8 * MiB)
        v.lib.fake_set_used(240 * MiB - v.lib.fake_used())
        v.lib.fake_fail(b"cudaMemGetInfo", 0, 1, 999)
        with pytest.raises(OutOfMemoryError, match="the device refused memory the cap allows: memory outside"):
            p.malloc(32 * MiB)
        x = oom.explain(p)
        assert (x.kind, x.room, x.held_outside) == ("device", None, None) and "did not say" in x.summary()
        assert x.as_dict()["held_outside"] is None
        doc = json.loads(oom.write_snapshot(p, tmp_path).with_suffix(".json").read_text())
        assert [e["device_free"] for e in doc["history"] if e["kind"] == "oom"][-1] is None
        v.lib.fake_set_used(0)


def test_held_outside_is_what_was_held_when_it_failed(builds: dict) -> None:
    v = _vendor(builds, "cuda")
    with v.pool() as p:
        keep = p.malloc(8 * MiB)
        v.lib.fake_set_used(240 * MiB - v.lib.fake_used())
        reserved = p.stats()["total"]["reserved"]["current"]
        with pytest.raises(OutOfMemoryError):
            p.malloc(32 * MiB)
        p.free(keep)
        p.empty_cache()  # the pool gives its memory back afterwards: what was held outside did not change
        x = oom.explain(p)
        assert x.held_outside == 256 * MiB - 16 * MiB - reserved and x.reserved_at_failure == reserved
        v.lib.fake_set_used(0)


def test_fraction_caps_what_is_mapped(vendor: Vendor) -> None:
    with vendor.pool(fraction=0.25) as p:
        a = p.malloc(60 * MiB)
        with pytest.raises(OutOfMemoryError, match="cap"):
            p.malloc(10 * MiB)
        assert vendor.lib.fake_used() <= 64 * MiB
        p.free(a)


def test_missing_library_names_it(vendor: Vendor) -> None:
    with pytest.raises(PoolError) as e:
        Pool(backend=vendor.backend, lib_path="/nonexistent/libvendor.so")
    assert e.value.code == NP_ERR_BACKEND and "/nonexistent/libvendor.so" in str(e.value)
    # a long path is named whole, with the loader's reason after it (messages were cut at 1 KiB,
    # and the CUDA backend cut a path past 1023 bytes and tried to load what was left)
    long = "/nonexistent/" + "d" * 250 + "/" + "e" * 3000 + "/libvendor.so"
    with pytest.raises(PoolError) as e:
        Pool(backend=vendor.backend, lib_path=long)
    assert long in str(e.value) and str(e.value).endswith(("long", "directory"))  # dlerror's reason, whole
    # one longer than a path may be is refused as such, not cut; for CUDA's RUNTIME:DRIVER, the part
    too_long = "/nonexistent/" + "f" * 5000 + "/libvendor.so"
    with pytest.raises(PoolError, match="5026 bytes, longer than the 4095 a path may have") as e:
        Pool(backend=vendor.backend, lib_path=too_long)
    assert e.value.code == NP_ERR_INVALID
    if vendor.backend == "cuda":
        with pytest.raises(PoolError, match="driver part .after ':'. is 5026 bytes") as e:
            Pool(backend="cuda", lib_path="/nonexistent/libcudart.so:" + too_long)


def test_a_library_path_that_is_no_regular_file_is_refused_without_blocking(vendor: Vendor, tmp_path: Path) -> None:
    """dlopen open()s the path it is given: a FIFO there blocked the pool's creation for ever
    (Pool and install(lib_path=...) alike). A driver the caller names for CUDA that does not
    load made a pool without virtual memory, silently (the first request reserved the device)."""
    fifo = tmp_path / "libvendor.so"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a FIFO"), (tmp_path, "a directory")):
        with pytest.raises(PoolError, match=f"from {path}: not a regular file \\({kind}\\)") as e:
            Pool(backend=vendor.backend, lib_path=str(path))
        assert e.value.code == NP_ERR_INVALID
    if vendor.backend == "cuda":
        with pytest.raises(PoolError, match="cannot load the CUDA driver .libcuda.*/typo/libcuda.so"):
            Pool(backend="cuda", lib_path=f"{vendor.path}:/typo/libcuda.so")
        with Pool(backend="cuda", lib_path=f"{vendor.path}:{vendor.path}") as p:  # the same, named: loads
            assert p.stats()["vmm"]


def test_a_close_racing_another_returns_once_the_memory_is_back(vendor: Vendor) -> None:
    """Pool.close marked the pool closed before np_close ran: a second close returned at once,
    while the first was still giving the device its memory back (1820 MiB still held, seen by a
    helper); both return once the device has it all now."""
    import threading

    for _ in range(20):
        p = vendor.pool("torch", vmm=False)
        for _ in range(200):
            p.malloc(MiB)  # 100 small-pool segments of 2 MiB
        first = threading.Thread(target=p.close)
        first.start()
        while not p._closed:  # the first close has begun
            pass
        p.close()
        assert vendor.lib.fake_used() == 0
        first.join()


def test_listing_calls_refuse_a_missing_buffer(vendor: Vendor) -> None:
    """The C API's listings with no buffer but room claimed for entries wrote through NULL (np_tags
    refused it)."""
    from npu_pool._core import ffi, lib

    with vendor.pool() as p:
        p.free(p.malloc(MiB))
        n = ffi.new("size_t *")
        for call in (lib.np_blocks, lib.np_mapped_ranges, lib.np_history):
            assert call(p.ctx, ffi.NULL, 4, n) == NP_ERR_INVALID and n[0] == 0
            assert "no buffer for 4 entries" in ffi.string(lib.np_last_error()).decode()
            assert call(p.ctx, ffi.NULL, 0, n) == 0  # asking for the count is fine
        p.check()


def test_a_library_without_the_vendor_symbols_is_named_whole(vendor: Vendor, tmp_path: Path) -> None:
    """A library that loads but is not the vendor's is named by the path the loader took it from,
    whole however long (the name was cut at 1 KiB, silently)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        unavailable("no C compiler to build an empty library")
    where = tmp_path.joinpath(*["g" * 200] * 6)
    where.mkdir(parents=True)
    lib = where / "libempty.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), "-x", "c", "/dev/null"], check=True, capture_output=True)
    with pytest.raises(PoolError) as e:
        Pool(backend=vendor.backend, lib_path=str(lib))
    assert e.value.code == NP_ERR_BACKEND and f"{lib} has no symbol" in str(e.value)


def test_missing_default_library_says_what_was_tried() -> None:
    for backend, name in (("acl", "libascendcl.so"), ("cuda", "libcudart")):
        try:
            ctypes.CDLL(f"{name}.so" if backend == "cuda" else name)
        except OSError:
            pass
        else:
            continue  # the real runtime is installed here
        with pytest.raises(PoolError, match=name):
            Pool(backend=backend)


@pytest.mark.parametrize("backend", ["acl", "cuda"])
def test_missing_symbol_names_it(builds: dict, backend: str) -> None:
    v = _vendor(builds, backend, "nofree")
    with pytest.raises(PoolError) as e:
        v.pool()
    assert e.value.code == NP_ERR_BACKEND
    assert NAMES[backend]["free"] in str(e.value) and v.path in str(e.value)


@pytest.mark.parametrize("backend", ["acl", "cuda"])
def test_without_vmm_symbols_the_arena_is_one_fixed_allocation(builds: dict, backend: str) -> None:
    v = _vendor(builds, backend, "novmm")
    with v.pool(fraction=0.5) as p:
        ptrs = [p.malloc(s) for s in (MiB, 7 * MiB, 300)]
        for a in ptrs:
            _fill(a, 300, 0x11)
        st = p.stats()
        assert st["vmm"] is False and st["device_mallocs"] == 1
        assert st["total"]["reserved"]["current"] == 128 * MiB == v.lib.fake_used()
        if backend == "acl":
            assert v.lib.fake_last_policy() == 0  # ACL_MEM_MALLOC_HUGE_FIRST
        for a in ptrs:
            p.free(a)
        p.empty_cache()  # nothing allocated: the fixed arena goes back
        assert v.lib.fake_used() == 0


def test_vmm_probe_failure_falls_back_to_a_fixed_arena(vendor: Vendor) -> None:
    vendor.lib.fake_set_vmm(0)
    with vendor.pool(fraction=0.5) as p:
        p.free(p.malloc(MiB))
        assert p.stats()["vmm"] is False and p.stats()["device_mallocs"] == 1
    with vendor.pool(fraction=0.5, vmm=False) as p:
        assert p.stats()["vmm"] is False
    with pytest.raises(ValueError, match="no VMM"):
        vendor.pool("expandable")  # needs virtual memory; the backend name says why there is none


def test_vendor_error_is_readable_and_the_books_match_the_device(vendor: Vendor) -> None:
    with vendor.pool() as p:
        keep = p.malloc(MiB)  # the first chunk (20 MiB)
        vendor.fail("map")  # the second chunk's map fails
        with pytest.raises(PoolError) as e:
            p.malloc(30 * MiB)
        msg = str(e.value)
        assert vendor.name("map") in msg and NAMES[vendor.backend]["internal_name"] in msg
        assert str(NAMES[vendor.backend]["internal"]) in msg
        if vendor.backend == "acl":
            assert "[fake ACL] aclrtMapMem failed" in msg  # aclGetRecentErrMsg's text
        # the first chunk stays mapped and counted, the failed one's memory went back: the books match
        st = p.stats()
        assert vendor.lib.fake_mapped() == vendor.lib.fake_used() == 20 * MiB == st["total"]["reserved"]["current"]
        assert st["unreleased"] == 0
        a = p.malloc(30 * MiB)
        _fill(a, 30 * MiB, 1)
        p.check()
        p.free(a)
        p.free(keep)


def test_unmap_failure_keeps_that_chunk_mapped_and_says_so(vendor: Vendor) -> None:
    with vendor.pool() as p:
        a = p.malloc(40 * MiB - vendor.pad)  # one chunk of exactly 40 MiB
        b = p.malloc(MiB)  # the next chunk (20 MiB)
        _fill(b, MiB, 0x77)
        p.free(a)
        vendor.fail("unmap")  # a's chunk refuses to unmap
        with pytest.raises(PoolError, match=vendor.name("unmap")):
            p.empty_cache()  # the caller hears about it ...
        # ... and the chunk is still mapped and counted
        assert vendor.lib.fake_mapped() == 60 * MiB == p.stats()["total"]["reserved"]["current"]
        p.check()
        c = p.malloc(40 * MiB - vendor.pad)  # the free range is usable again
        _fill(c, 40 * MiB - vendor.pad, 0x33)
        assert _holds(b, MiB, 0x77)
        p.free(c)
        p.empty_cache()  # this time the free chunk goes back
        assert vendor.lib.fake_mapped() == 20 * MiB == p.stats()["total"]["reserved"]["current"]
        p.check()
        p.free(b)


def test_calls_run_on_the_pool_device_and_restore_the_callers(builds: dict, vendor: Vendor) -> None:
    vendor.lib.fake_set_current_device(1)
    with vendor.pool(device=0) as p:
        p.free(p.malloc(3 * MiB))
        p.empty_cache()
        assert vendor.lib.fake_last_device() == 0
        assert vendor.lib.fake_current_device() == 1
    with pytest.raises(PoolError, match="device 7"):
        vendor.pool(device=7)


def _reuse_both_ways(v: Vendor) -> dict[str, int]:
    """Stream 2 reuses stream 1's memory, then stream 1 stream 2's: two event waits on the device,
    no host synchronisation. The pool's call counts, read before it closes."""
    with v.pool() as p:
        a = p.malloc(4 * MiB, stream=1)
        keep = p.malloc(MiB, stream=1)
        p.free(a)
        b = p.malloc(4 * MiB, stream=2)
        assert b == a and v.calls("wait") == 1 and p.stats()["stream_waits"] == 1
        p.free(b)
        c = p.malloc(4 * MiB, stream=1)
        assert c == a and v.calls("wait") == 2 and p.stats()["stream_waits"] == 2
        assert v.calls("sync") == 0
        p.free(c)
        p.free(keep)
        calls = p.stats()["calls"]
    assert v.lib.fake_live() == 0  # events destroyed too
    return calls


def test_cross_stream_reuse_waits_on_the_device(vendor: Vendor) -> None:
    calls = _reuse_both_ways(vendor)
    # one event, made at the first wait and recorded again for the second, destroyed at close
    assert (calls["event_create"], calls["event_record"], calls["event_wait"], calls["event_destroy"]) == (1, 2, 2, 0)


def test_close_reports_an_event_the_device_refused_to_destroy(vendor: Vendor) -> None:
    """close() returns every byte, then says so when the device refuses to destroy the pool's
    cross-stream event (before: it returned as if all went well, and the event leaked unsaid)."""
    p = vendor.pool()
    a = p.malloc(4 * MiB, stream=1)
    p.free(a)
    p.free(p.malloc(4 * MiB, stream=2))  # reuse across streams: the backend makes its event
    vendor.fail("event_destroy")
    with pytest.raises(BackendError, match=f"{vendor.name('event_destroy')}.*cross-stream event"):
        p.close()
    assert vendor.lib.fake_used() == 0 and vendor.lib.fake_live() == 1  # the memory back; the event the device kept
    p.close()  # closed: nothing more to do


def test_a_failed_event_wait_fails_the_request_and_the_next_wait_works(vendor: Vendor) -> None:
    with vendor.pool() as p:
        a = p.malloc(4 * MiB, stream=1)
        keep = p.malloc(MiB, stream=1)
        p.free(a)
        before = p.stats()
        vendor.fail("wait")
        with pytest.raises(PoolError, match=vendor.name("wait")):
            p.malloc(4 * MiB, stream=2)
        after = p.stats()
        assert after["total"]["allocated"]["current"] == before["total"]["allocated"]["current"]
        assert after["total"]["reserved"]["current"] == before["total"]["reserved"]["current"] == vendor.lib.fake_used()
        b = p.malloc(4 * MiB, stream=2)  # the same memory, ordered this time
        assert b == a and vendor.calls("wait") == 2
        p.free(b)
        p.free(keep)
    assert vendor.lib.fake_live() == 0


def test_an_older_acl_runtime_gets_an_event_for_each_wait(builds: dict) -> None:
    v = _vendor(builds, "acl", "oldevents")
    calls = _reuse_both_ways(v)
    assert (calls["event_create"], calls["event_record"], calls["event_wait"], calls["event_destroy"]) == (2, 2, 2, 2)
    assert v.lib.fake_calls(b"aclrtCreateEvent") == v.lib.fake_calls(b"aclrtDestroyEvent") == 2


@pytest.mark.parametrize("busy", [False, True])
def test_trim_unmaps_pages_of_a_busy_stream_once_the_device_is_synchronised(vendor: Vendor, busy: bool) -> None:
    """Under the cap a trim unmaps free pages whose stream has finished; where it still runs work
    that may use them, the trim waits for the device (one synchronisation) rather than skip them,
    so that what it unmaps does not depend on timing: the same trim, no retry, either way."""
    with vendor.pool(fraction=0.125) as p:  # cap: 32 MiB
        a = p.malloc(16 * MiB, stream=1)
        b = p.malloc(8 * MiB, stream=1)
        p.free(a)
        vendor.lib.fake_set_busy(1, int(busy))  # stream 1 still runs work that may use a's pages
        syncs = vendor.calls("sync")
        c = p.malloc(20 * MiB, stream=2)  # needs a's pages back under the cap
        st = p.stats()
        assert (st["trims"], st["retries"]) == (1, 0)
        assert vendor.calls("sync") - syncs == int(busy)  # only a busy stream is waited for
        p.free(c)
        p.free(b)
        p.check()


@pytest.mark.parametrize("policy", ["npu_pool", "expandable", "planned", "torch"])
def test_close_waits_for_the_device_before_it_returns_memory(vendor: Vendor, policy: str) -> None:
    """Work still queued on freed memory (here another stream's) finishes before close() unmaps and
    returns it, as before empty_cache(): close made no synchronisation under the VMM policies (a review
    of the core, a helper), so a kernel still running could touch unmapped memory."""
    p = vendor.pool(policy)
    p.free(p.malloc(8 * MiB, stream=1))  # a kernel queued on stream 1 may still read this block
    vendor.lib.fake_set_busy(1, 1)
    syncs, returned = vendor.calls("sync"), vendor.calls("unmap") + vendor.calls("free")
    p.close()
    vendor.lib.fake_set_busy(1, 0)
    assert vendor.calls("unmap") + vendor.calls("free") > returned  # memory went back
    waits_itself = policy == "torch" and vendor.backend == "cuda"  # cudaFree waits for the device
    assert vendor.calls("sync") - syncs == (0 if waits_itself else 1)  # once, first (aclrtFree's too)
    assert vendor.lib.fake_used() == 0


def test_a_request_synchronises_the_device_once_however_it_fails(vendor: Vendor) -> None:
    """A trim that waited for a busy stream leaves the device idle for the rest of the request:
    the retry after it does not synchronise again (one synchronisation, one retry, then the
    out-of-memory error; the books still match the device)."""
    with vendor.pool(fraction=0.125) as p:  # cap: 32 MiB
        a = p.malloc(16 * MiB, stream=1)
        b = p.malloc(8 * MiB, stream=1)
        p.free(a)
        vendor.lib.fake_set_busy(1, 1)
        syncs = vendor.calls("sync")
        with pytest.raises(OutOfMemoryError):
            p.malloc(30 * MiB, stream=2)  # a's pages back are not enough: b holds 8 of the 32 MiB
        vendor.lib.fake_set_busy(1, 0)
        assert vendor.calls("sync") - syncs == 1 and p.stats()["retries"] == 1
        p.free(b)
        p.check()
        assert vendor.lib.fake_used() == p.stats()["total"]["reserved"]["current"]


def _counts(vendor: Vendor) -> dict[str, int]:
    return {op: vendor.calls(op) for op in ("create", "release", "map", "unmap")}


def _since(vendor: Vendor, before: dict[str, int]) -> dict[str, int]:
    """The vendor's chunk calls of each kind since `before` (a _counts)."""
    return {op: n - before[op] for op, n in _counts(vendor).items()}


def test_a_forked_child_leaves_the_parents_spares_alone(vendor: Vendor) -> None:
    """A child forked while the pool keeps a spare reads it in the statistics and closes the pool
    without a device call (the memory is the parent's); the parent maps the spare again after."""
    import os

    with vendor.pool(fraction=0.125) as p:
        _spare_left(vendor, p)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: no pytest assertions here, one status byte back
            ok = False
            try:
                before = _counts(vendor)
                spare = p.stats()["spare"]
                p.close()
                ok = spare == 4 * MiB and _counts(vendor) == before
            finally:
                os.write(w, bytes([ok]))
                os._exit(0)
        os.waitpid(pid, 0)
        assert os.read(r, 1) == bytes([1])
        before = _counts(vendor)
        p.malloc(4 * MiB - vendor.pad, lifetime="short")  # maps the spare: no creation
        d = _since(vendor, before)
        assert (d["map"], d["create"]) == (1, 0) and p.stats()["spare"] == 0
        p.check()
    assert vendor.lib.fake_used() == 0 and vendor.lib.fake_live() == 0


def test_a_forked_child_cannot_pause_resume_or_plan_on_the_parents_memory(vendor: Vendor) -> None:
    """In a child forked from a vendor-backed pool, pause, resume, region, set_backup_limit and
    installing a plan are refused with the forked-child message and make no device call (pause
    and resume unmapped and mapped the parent's memory before); the parent's pool is intact."""
    import os

    with vendor.pool() as p, vendor.pool("planned") as planned:
        with p.region("a"):
            p.malloc(4 * MiB)
        p.pause("a")  # resume in the child would map the parent's chunks again
        calls = [("pause", lambda: p.pause("a")), ("resume", lambda: p.resume("a")),
                 ("region", lambda: p.region("b").__enter__()),
                 ("set_backup_limit", lambda: p.set_backup_limit(MiB)),
                 ("set_plan", lambda: planned.set_plan([MiB], [0], [MiB], 0, 0, 0))]
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: no pytest assertions here, one status byte per call
            out = bytearray()
            try:
                for _, call in calls:
                    before = _counts(vendor)
                    try:
                        call()
                        out.append(0)
                    except PoolError as e:
                        out.append(1 + ("fork of the one that made this pool" in str(e) and _counts(vendor) == before))
            finally:
                os.write(w, bytes(out))
                os._exit(0)
        os.waitpid(pid, 0)
        got = os.read(r, 64)
        assert dict(zip([n for n, _ in calls], got)) == {n: 2 for n, _ in calls}
        p.resume("a")  # the parent's own: mapped again here
        p.check()
        assert p.tags()["a"]["is_paused"] is False
    """Past half the cap a growth is exactly the shortfall: the pages the block covers whole are one
    chunk and a page it shares with a neighbour one of its own, not a chunk per page."""
    with vendor.pool(fraction=0.125) as p:  # cap: 32 MiB
        before = _counts(vendor)
        a = p.malloc(17 * MiB - vendor.pad)  # 8 whole pages and half of a ninth
        d = _since(vendor, before)
        assert (d["create"], d["map"]) == (2, 2) and vendor.lib.fake_mapped() == 18 * MiB
        p.free(a)
        p.empty_cache()
        assert vendor.lib.fake_used() == 0


def test_near_the_cap_a_block_of_whole_pages_starts_on_a_page_boundary(vendor: Vendor) -> None:
    """Past half the cap a request of whole pages that grows the top from inside a page starts on
    the next page: one chunk of its own pages instead of two (the pages it covers whole and the
    page it would share with the next block). The piece of the page it skips is a hole a smaller
    request takes without a device call."""
    with vendor.pool(fraction=0.125) as p:  # cap: 32 MiB
        a = p.malloc(17 * MiB - vendor.pad)  # 8 whole pages and half of a ninth: two chunks
        before = _counts(vendor)
        b = p.malloc(4 * MiB - vendor.pad)  # two whole pages: the tenth and eleventh
        d = _since(vendor, before)
        assert (d["create"], d["map"]) == (1, 1) and b - a == 18 * MiB
        assert vendor.lib.fake_mapped() == 22 * MiB
        before = _counts(vendor)
        c = p.malloc(MiB - vendor.pad)  # the rest of the ninth page
        assert c - a == 17 * MiB and _since(vendor, before) == dict.fromkeys(before, 0)
        p.check()
        for x in (b, a, c):
            p.free(x)
        p.empty_cache()
        assert vendor.lib.fake_used() == 0


def test_while_nothing_is_freed_far_from_the_cap_the_arena_grows_geometrically(vendor: Vendor) -> None:
    """Far from the cap, while the arena holds no free memory below its top (a set-up that only
    places), a growth maps an eighth of what the arena holds where that is more than the 20 MiB
    granule: 256 blocks of 10 MiB take a few dozen chunks, not 128. While a freed block's hole
    stays free inside the arena, a growth is one granule again."""
    vendor.lib.fake_set_capacity(8 * 1024 * MiB)  # growths turn exact past 4 GiB
    with vendor.pool() as p:
        before = _counts(vendor)
        blocks = [p.malloc(10 * MiB - vendor.pad) for _ in range(256)]
        d = _since(vendor, before)
        assert d["create"] == d["map"] and 24 <= d["create"] <= 40
        mapped = vendor.lib.fake_mapped()
        assert 2560 * MiB <= mapped <= 2560 * MiB * 9 // 8 + 2 * MiB  # an eighth ahead at most
        p.free(blocks[100])  # a hole the larger blocks below do not fit: growths are granules
        while vendor.lib.fake_mapped() == mapped:
            blocks.append(p.malloc(12 * MiB - vendor.pad))
        assert vendor.lib.fake_mapped() - mapped == 20 * MiB
        p.check()
        for b in blocks[:100] + blocks[101:]:
            p.free(b)
        p.empty_cache()
        assert vendor.lib.fake_used() == 0


@pytest.mark.parametrize("busy", [False, True])
def test_a_block_placed_in_a_free_chunk_under_pressure_does_not_pin_it(vendor: Vendor, busy: bool) -> None:
    """Under cap pressure a block that must go inside a wholly free chunk (no other place) unmaps
    the chunk first, as a trim, and maps only its own page: the chunk's other pages can serve a
    growth elsewhere. While the stream that freed the chunk still runs work, the device is
    synchronised first (once): the same layout either way."""
    with vendor.pool(fraction=0.125) as p:  # cap: 32 MiB
        p.malloc(16 * MiB - vendor.pad, lifetime="long")
        b = p.malloc(8 * MiB - vendor.pad, lifetime="short", stream=1)  # one chunk of 4 pages
        p.malloc(2 * MiB - vendor.pad, lifetime="short")
        p.free(b)
        vendor.lib.fake_set_busy(1, int(busy))
        before, syncs = _counts(vendor), vendor.calls("sync")
        p.malloc(MiB - vendor.pad, lifetime="short", stream=1)  # only b's hole has room
        d = _since(vendor, before)
        assert vendor.calls("sync") - syncs == int(busy)
        # the chunk stays the pool's, unmapped (a spare): the cap holds it and the new page
        assert (d["unmap"], d["release"], d["create"], d["map"]) == (1, 0, 1, 1) and p.stats()["trims"] == 1
        assert vendor.lib.fake_mapped() == 20 * MiB and p.stats()["spare"] == 8 * MiB
        vendor.lib.fake_set_busy(1, 0)
        before = _counts(vendor)
        p.malloc(12 * MiB - vendor.pad, lifetime="short")  # fits the cap: nothing is pinned
        d = _since(vendor, before)
        # the spare maps over 4 of the block's pages, a new chunk over the rest
        assert (d["release"], d["create"], d["map"]) == (0, 1, 2) and p.stats()["spare"] == 0
        st = p.stats()
        assert vendor.lib.fake_used() == st["total"]["reserved"]["current"] == vendor.lib.fake_mapped() + st["spare"]
        p.check()
    assert vendor.lib.fake_live() == 0


def test_a_device_with_less_than_the_cap_gets_the_spares_back_before_a_new_chunk(vendor: Vendor) -> None:
    """A spare stays the pool's while the cap holds it and a new chunk together. Where the device
    itself has less than the cap (another process took the rest), the creation it refuses gives
    every spare back and is asked once more: the request is served, the books match the device."""
    with vendor.pool(fraction=0.125) as p:  # cap: 32 MiB
        p.malloc(16 * MiB - vendor.pad, lifetime="long")
        b = p.malloc(8 * MiB - vendor.pad, lifetime="short", stream=1)
        p.malloc(2 * MiB - vendor.pad, lifetime="short")
        p.free(b)
        p.malloc(MiB - vendor.pad, lifetime="short", stream=1)  # unpins b's chunk: a spare of 4 pages
        assert p.stats()["spare"] == 8 * MiB and vendor.lib.fake_mapped() == 20 * MiB
        vendor.lib.fake_set_used(256 * MiB - vendor.lib.fake_used())  # the device is full
        before = _counts(vendor)
        p.malloc(2 * MiB - vendor.pad, lifetime="short")  # one page: the spare cannot map there
        d = _since(vendor, before)
        assert (d["release"], d["create"], d["map"]) == (1, 2, 1)  # refused, the spare back, served
        st = p.stats()
        assert st["spare"] == 0 and vendor.lib.fake_mapped() == 22 * MiB
        assert vendor.lib.fake_used() == st["total"]["reserved"]["current"] == 22 * MiB
        p.check()
        vendor.lib.fake_set_used(0)
    assert vendor.lib.fake_live() == 0


def test_a_creation_leaves_at_most_a_growth_granule_of_spares(vendor: Vendor) -> None:
    """Spares the cap could hold beside a new chunk stay only up to 20 MiB (a growth granule):
    past that they are reserved memory nothing maps. Two 16 MiB chunks unpinned by small blocks
    become spares; the second small block's own page is a creation, before which one spare goes
    back and the other stays."""
    with vendor.pool(fraction=0.5) as p:  # cap: 128 MiB; past 64 MiB growths are exact
        p.malloc(64 * MiB - vendor.pad, lifetime="long")
        a = p.malloc(16 * MiB - vendor.pad, lifetime="short", stream=1)  # one chunk of 8 pages
        p.malloc(2 * MiB - vendor.pad, lifetime="short")
        b = p.malloc(16 * MiB - vendor.pad, lifetime="short", stream=2)
        p.malloc(2 * MiB - vendor.pad, lifetime="short")
        p.free(a)
        p.free(b)
        before = _counts(vendor)
        p.malloc(MiB - vendor.pad, lifetime="short", stream=1)  # unpins a's chunk: a 16 MiB spare, kept
        p.malloc(15 * MiB - vendor.pad, lifetime="short", stream=1)  # the rest of a's hole: 7 new pages
        assert p.stats()["spare"] == 16 * MiB and vendor.calls("release") == before["release"]
        p.malloc(MiB - vendor.pad, lifetime="short", stream=2)  # unpins b's: 32 MiB, more than 20
        d = _since(vendor, before)
        assert (d["unmap"], d["release"], d["create"]) == (2, 1, 3)
        st = p.stats()
        assert st["spare"] == 16 * MiB
        assert vendor.lib.fake_used() == st["total"]["reserved"]["current"] == vendor.lib.fake_mapped() + st["spare"]
        p.check()
    assert vendor.lib.fake_live() == 0


@pytest.mark.parametrize("fault", [False, True])
def test_a_trim_maps_its_chunks_again_instead_of_releasing_and_creating(vendor: Vendor, fault: bool) -> None:
    """Under the cap, the growth that follows a trim in the same call maps the trimmed chunk's
    physical allocation again (the vendor takes it at another address): an unmap and a map where
    there were a release, an unmap, a creation and a map. A spare the growth does not use, or
    whose map fails, goes back to the device in the same call: the books always match it."""
    with vendor.pool(fraction=0.125) as p:  # cap: 32 MiB; past 16 MiB growth is exact
        a = p.malloc(16 * MiB - vendor.pad, lifetime="short")  # one chunk of 8 pages
        b = p.malloc(8 * MiB - vendor.pad, lifetime="short")
        p.free(a)
        before = _counts(vendor)
        if fault:
            vendor.fail("map")  # the spare's map
            with pytest.raises(PoolError, match=NAMES[vendor.backend]["map"]):
                p.malloc(20 * MiB - vendor.pad, lifetime="short")
            d = _since(vendor, before)
            assert d["unmap"] == 1 and d["release"] == 1 and d["create"] == 0  # the spare is gone, not lost
        c = p.malloc(20 * MiB - vendor.pad, lifetime="short")  # needs a's pages back under the cap
        d = _since(vendor, before)
        assert p.stats()["trims"] == 1 and d["unmap"] == 1
        if not fault:
            assert d["release"] == 0, "the trimmed chunk was released instead of mapped again"
            assert d["map"] == d["create"] + 1  # one map of the spare, the rest new chunks
        _fill(c, 20 * MiB - vendor.pad, 0x5A)
        assert _holds(c, 20 * MiB - vendor.pad, 0x5A)
        assert vendor.lib.fake_used() == p.stats()["total"]["reserved"]["current"] == vendor.lib.fake_mapped()
        p.check()
        p.free(b)
        p.free(c)
        p.empty_cache()
        assert vendor.lib.fake_used() == 0 and p.stats()["unreleased"] == 0
    assert vendor.lib.fake_live() == 0


def _spare_left(vendor: Vendor, p: Pool) -> None:
    """Leave one spare: with the cap full, a trim unmaps the two 2-page chunks of a freed hole
    (past half the cap a block's whole pages are one chunk) and the growth that follows maps one."""
    p.malloc(16 * MiB - vendor.pad, lifetime="long")
    y1 = p.malloc(4 * MiB - vendor.pad, lifetime="short")
    y2 = p.malloc(4 * MiB - vendor.pad, lifetime="short")
    p.malloc(2 * MiB - vendor.pad, lifetime="short")
    t = p.malloc(6 * MiB - vendor.pad, lifetime="short")
    for x in (y1, y2, t):
        p.free(x)
    before = _counts(vendor)
    p.malloc(10 * MiB - vendor.pad, lifetime="short")  # 2 pages more than the top has mapped
    d = _since(vendor, before)
    assert (d["unmap"], d["map"], d["create"], d["release"]) == (2, 1, 0, 0)
    st = p.stats()
    assert st["trims"] == 1 and st["spare"] == 4 * MiB
    # the device holds the spare for the pool: reserved, not mapped
    assert vendor.lib.fake_used() == st["total"]["reserved"]["current"] == vendor.lib.fake_mapped() + 4 * MiB
    p.check()


def test_a_request_short_of_memory_first_retries_what_the_device_refused_to_take_back(vendor: Vendor) -> None:
    """Memory the device refused to release (here a spare, given back at a new cap) is counted
    reserved and held. A request that finds the cap full asks the device again before failing
    (before: it failed as 'a real shortage' until the next empty_cache); while the device still
    refuses, the out-of-memory message says how much of the reserved memory that is."""
    with vendor.pool(fraction=0.125) as p:
        _spare_left(vendor, p)
        vendor.fail("release", count=1)
        p.set_fraction(0.125)  # gives the spare back: refused, held
        assert p.stats()["unreleased"] == 4 * MiB
        vendor.fail("release", count=1)
        with pytest.raises(OutOfMemoryError, match="of the reserved, 4.00 MiB is memory the device refused"):
            p.malloc(4 * MiB - vendor.pad, lifetime="short")  # asked again: refused again
        p.malloc(4 * MiB - vendor.pad, lifetime="short")  # asked again: taken back, and served
        st = p.stats()
        assert st["unreleased"] == 0 and vendor.lib.fake_used() == st["total"]["reserved"]["current"]
        p.check()


@pytest.mark.parametrize("backend", ["acl", "cuda"])
def test_spares_go_back_before_the_planned_region(builds: dict, backend: str) -> None:
    """A spare is counted against the cap like mapped memory, but it is the pool's to give back: a
    device allocation (the planned policy's region) gives spares back before it asks, so that a
    full device still serves it."""
    v = _vendor(builds, backend, capacity=32 * MiB)
    with v.pool("planned") as p:  # the cap is the whole device
        _spare_left(v, p)
        assert v.lib.fake_used() == 32 * MiB  # the device is full, the spare included
        asked = 4 * MiB - v.pad // 2  # what the pool asks of a 4 MiB - pad request (ACL: 32-byte rounded, plus 32)
        p.set_plan([asked], [0], [2**64 - 1], 0, 4 * MiB, 2)  # 2: position 0 is the next request
        before = _counts(v)
        p.malloc(4 * MiB - v.pad)  # fits on the device only once the spare is given back
        assert p.plan_counts()["served"] == 1
        d = _since(v, before)
        assert (d["release"], d["create"], d["map"]) == (1, 0, 0)
        st = p.stats()
        assert st["spare"] == 0 and st["total"]["reserved"]["current"] == 32 * MiB == v.lib.fake_used()
        p.check()
    assert v.lib.fake_used() == 0 and v.lib.fake_live() == 0


@pytest.mark.parametrize("then", ["growth", "empty_cache", "refused", "set_fraction", "close"])
def test_a_spare_outlives_its_call_counted_as_reserved_until_mapped_or_given_back(vendor: Vendor, then: str) -> None:
    """A chunk a trim unmapped and the growth did not need stays with the pool (a spare, counted
    as reserved) for a later growth to map instead of creating one; empty_cache, a new cap and
    close give it back, and a release the device refuses is held, never lost."""
    with vendor.pool(fraction=0.125) as p:  # cap: 32 MiB of 2 MiB pages
        _spare_left(vendor, p)
        before = _counts(vendor)
        if then == "growth":
            p.malloc(4 * MiB - vendor.pad, lifetime="short")  # two pages to map: the spare's
            d = _since(vendor, before)
            assert (d["map"], d["create"], d["release"]) == (1, 0, 0) and p.stats()["spare"] == 0
        elif then in ("empty_cache", "refused"):
            if then == "refused":
                vendor.fail("release")
                with pytest.raises(BackendError, match="still holds 4.00 MiB"):
                    p.empty_cache()
            else:
                p.empty_cache()
            st = p.stats()
            assert st["spare"] == 0 and st["unreleased"] == (4 * MiB if then == "refused" else 0)
            assert vendor.calls("release") == before["release"] + 1
            if then == "refused":  # held, counted, and given back at the next empty_cache
                p.empty_cache()
                assert p.stats()["unreleased"] == 0
        elif then == "set_fraction":
            p.set_fraction(0.125)
            assert p.stats()["spare"] == 0 and vendor.calls("release") == before["release"] + 1
        if then != "close":
            st = p.stats()
            assert vendor.lib.fake_used() == st["total"]["reserved"]["current"] == vendor.lib.fake_mapped() + st["spare"]
            p.check()
    assert vendor.lib.fake_used() == 0 and vendor.lib.fake_live() == 0


@pytest.mark.parametrize("policy", ["torch", "expandable"])
def test_other_policies_run_on_vendor_backends(vendor: Vendor, policy: str) -> None:
    with vendor.pool(policy) as p:
        ptrs = [p.malloc(s) for s in (512, MiB, 12 * MiB, 30 * MiB)]
        for i, a in enumerate(ptrs):
            _fill(a, 512, i)
        for a in ptrs:
            p.free(a)
        p.empty_cache()
        p.check()
    assert vendor.lib.fake_used() == 0 and vendor.lib.fake_live() == 0


def test_cached_segments_go_back_after_one_synchronisation_per_call(vendor: Vendor) -> None:
    """aclrtFree does not wait for the device: the pool synchronises once, then frees every cached
    segment of that call (as torch_npu does); cudaFree waits by itself: no explicit call is added."""
    with vendor.pool("torch") as p:
        for a in [p.malloc(12 * MiB) for _ in range(3)]:  # three segments, all cached
            p.free(a)
        before = vendor.calls("sync"), vendor.calls("free")
        p.empty_cache()
        frees = vendor.calls("free") - before[1]
        assert frees == 3 and vendor.calls("sync") - before[0] == 1  # the empty_cache's own synchronisation
        p.free(p.malloc(12 * MiB))
        vendor.fail("sync")  # the synchronisation fails: nothing is freed under queued work
        with pytest.raises(PoolError, match=vendor.name("sync")):
            p.empty_cache()
        assert vendor.calls("free") - before[1] == 3
        p.empty_cache()  # once the device answers, the segment goes back
        assert vendor.calls("free") - before[1] == 4
        for a in [p.malloc(12 * MiB) for _ in range(3)]:
            p.free(a)
        p.check()
        before = vendor.calls("sync"), vendor.calls("free")
    # closing frees the three cached segments: first one synchronisation where the free does not wait
    assert vendor.calls("free") - before[1] == 3
    assert vendor.calls("sync") - before[0] == (1 if vendor.backend == "acl" else 0)
    assert vendor.lib.fake_used() == 0


def test_acl_reserve_flags_fall_back_to_zero(builds: dict) -> None:
    v = _vendor(builds, "acl")
    v.lib.fake_set_flags_reserved(1)  # a runtime where flags is reserved and must be 0
    with v.pool() as p:
        assert p.stats()["vmm"] is True
        p.free(p.malloc(MiB))
