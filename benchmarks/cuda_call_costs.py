"""What each device call costs on this machine's NVIDIA GPU: microseconds per call, measured.

    python benchmarks/cuda_call_costs.py [--sizes 2,20,512] [--repeat 5] [--count 64] [--json FILE]

npu_pool's replays count device calls by kind (``npu_pool.vocab.CALL_NAMES``) and multiply them
by a cost table (``npu_pool/device_costs.py``: stated assumptions, no measurement). This script
measures the memory calls of that vocabulary on the real CUDA runtime and driver, through ctypes:
``cudaMalloc``/``cudaFree`` (a segment, as PyTorch's caching allocator takes one), and the VMM
sequence npu_pool and PyTorch's expandable segments use (``cuMemAddressReserve``, ``cuMemCreate``,
``cuMemMap``, ``cuMemSetAccess``, ``cuMemUnmap``, ``cuMemRelease``, ``cuMemAddressFree``), plus
``cudaDeviceSynchronize`` on an idle device. Each figure is the median over ``--repeat`` rounds of
the mean over ``--count`` calls of one kind in a row, per size (MiB). ``--json FILE`` writes the
cost table at the middle size, ``{kind: microseconds}``, for ``npu-pool replay --costs FILE``.

It needs no torch; it loads ``libcudart`` (``NPU_POOL_CUDART`` or the usual names, torch's
nvidia/cu*/lib folders included) and ``libcuda.so.1``. Exit 2 with a message when there is no GPU.
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import statistics
import sys
import time
from typing import Callable

MiB = 1 << 20
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class GPUError(RuntimeError):
    """A CUDA call failed; the message names it and its error code."""


def _load_runtime() -> ctypes.CDLL:
    names = [os.environ.get("NPU_POOL_CUDART", "")] + ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
    for site in sys.path:  # pip's nvidia-cuda-runtime wheels, where torch finds them
        names += sorted(glob.glob(os.path.join(site, "nvidia", "cu*", "lib", "libcudart.so*")))
        names += sorted(glob.glob(os.path.join(site, "nvidia", "cuda_runtime", "lib", "libcudart.so*")))
    for name in filter(None, names):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise GPUError("the CUDA runtime (libcudart) was not found; set NPU_POOL_CUDART to its path")


class Cuda:
    """The runtime and driver functions measured, each checked."""

    def __init__(self) -> None:
        self.rt = _load_runtime()
        try:
            self.drv = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise GPUError(f"the CUDA driver (libcuda.so.1) was not found: {e}") from None
        n = ctypes.c_int(0)
        if self.rt.cudaGetDeviceCount(ctypes.byref(n)) != 0 or n.value < 1:
            raise GPUError("no CUDA GPU is visible (cudaGetDeviceCount)")
        self.check("cudaSetDevice", self.rt.cudaSetDevice(0))
        self.check("cudaFree(0)", self.rt.cudaFree(None))  # makes the primary context current
        self.prop = _Prop(type=CU_MEM_ALLOCATION_TYPE_PINNED, location=_Location(CU_MEM_LOCATION_TYPE_DEVICE, 0))
        self.access = _Access(location=_Location(CU_MEM_LOCATION_TYPE_DEVICE, 0),
                              flags=CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        gran = ctypes.c_size_t(0)
        self.check("cuMemGetAllocationGranularity",
                   self.drv.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(self.prop), 0))
        self.granularity = gran.value
        self.drv.cuMemAddressReserve.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t, ctypes.c_size_t,
                                                 ctypes.c_uint64, ctypes.c_uint64]
        self.drv.cuMemAddressFree.argtypes = [ctypes.c_uint64, ctypes.c_size_t]
        self.drv.cuMemCreate.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t, ctypes.POINTER(_Prop),
                                         ctypes.c_uint64]
        self.drv.cuMemRelease.argtypes = [ctypes.c_uint64]
        self.drv.cuMemMap.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_uint64,
                                      ctypes.c_uint64]
        self.drv.cuMemUnmap.argtypes = [ctypes.c_uint64, ctypes.c_size_t]
        self.drv.cuMemSetAccess.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER(_Access),
                                            ctypes.c_size_t]
        self.rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        self.rt.cudaFree.argtypes = [ctypes.c_void_p]

    @staticmethod
    def check(what: str, rc: int) -> None:
        if rc != 0:
            raise GPUError(f"{what} failed with error {rc}")


def _timed(calls: list[Callable[[], int]], what: str) -> float:
    """Microseconds per call of ``calls`` run in a row (each must return 0)."""
    t0 = time.perf_counter_ns()
    for c in calls:
        rc = c()
        if rc != 0:
            raise GPUError(f"{what} failed with error {rc}")
    return (time.perf_counter_ns() - t0) / 1e3 / len(calls)


def round_costs(cu: Cuda, size: int, count: int) -> dict[str, float]:
    """One round at ``size`` bytes: ``count`` calls of each kind in a row, in the order a pool makes them."""
    rt, drv, out = cu.rt, cu.drv, {}
    ptrs = [ctypes.c_void_p() for _ in range(count)]
    out["malloc"] = _timed([lambda p=p: rt.cudaMalloc(ctypes.byref(p), size) for p in ptrs], "cudaMalloc")
    out["free"] = _timed([lambda p=p: rt.cudaFree(p) for p in ptrs], "cudaFree")
    va = ctypes.c_uint64(0)
    t0 = time.perf_counter_ns()
    cu.check("cuMemAddressReserve", drv.cuMemAddressReserve(ctypes.byref(va), size * count, 0, 0, 0))
    out["reserve"] = (time.perf_counter_ns() - t0) / 1e3
    handles = [ctypes.c_uint64(0) for _ in range(count)]
    out["phys_create"] = _timed([lambda h=h: drv.cuMemCreate(ctypes.byref(h), size, ctypes.byref(cu.prop), 0)
                                 for h in handles], "cuMemCreate")
    addrs = [va.value + i * size for i in range(count)]
    out["map"] = _timed([lambda a=a, h=h: drv.cuMemMap(a, size, 0, h.value, 0) for a, h in zip(addrs, handles)],
                        "cuMemMap")
    out["set_access"] = _timed([lambda a=a: drv.cuMemSetAccess(a, size, ctypes.byref(cu.access), 1) for a in addrs],
                               "cuMemSetAccess")
    out["unmap"] = _timed([lambda a=a: drv.cuMemUnmap(a, size) for a in addrs], "cuMemUnmap")
    out["phys_release"] = _timed([lambda h=h: drv.cuMemRelease(h.value) for h in handles], "cuMemRelease")
    t0 = time.perf_counter_ns()
    cu.check("cuMemAddressFree", drv.cuMemAddressFree(va.value, size * count))
    out["release"] = (time.perf_counter_ns() - t0) / 1e3
    out["sync_device"] = _timed([rt.cudaDeviceSynchronize] * count, "cudaDeviceSynchronize")
    return out


def measure(sizes_mib: list[int], repeat: int, count: int) -> dict[int, dict[str, float]]:
    """{size MiB: {kind: median microseconds per call}}; sizes rounded up to the granularity."""
    cu = Cuda()
    res = {}
    for mib in sizes_mib:
        size = -(-mib * MiB // cu.granularity) * cu.granularity
        round_costs(cu, size, min(count, 4))  # warm-up: first calls load code and grow driver tables
        rounds = [round_costs(cu, size, count) for _ in range(repeat)]
        res[mib] = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="2,20,512", help="sizes in MiB, comma separated")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--count", type=int, default=64, help="calls of one kind in a row (and live at once)")
    ap.add_argument("--json", help="write the cost table at the middle size here")
    args = ap.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        ap.error(f"--sizes: expected MiB numbers separated by commas, got {args.sizes!r}")
    if not sizes or min(sizes) < 1 or args.repeat < 1 or args.count < 1:
        ap.error("--sizes, --repeat and --count must be positive")
    try:
        res = measure(sizes, args.repeat, args.count)
    except GPUError as e:
        print(f"cuda_call_costs: {e}", file=sys.stderr)
        return 2
    kinds = list(next(iter(res.values())))
    print(f"microseconds per call (median of {args.repeat} rounds of {args.count} calls in a row)\n")
    print("| kind | " + " | ".join(f"{m} MiB" for m in sizes) + " |")
    print("|---|" + "---:|" * len(sizes))
    for k in kinds:
        print(f"| {k} | " + " | ".join(f"{res[m][k]:.1f}" for m in sizes) + " |")
    print("\n(reserve and release: one call per round, of count x size bytes)")
    if args.json:
        mid = sizes[len(sizes) // 2]
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({k: round(v, 2) for k, v in res[mid].items()}, f, indent=1)
        print(f"wrote the {mid} MiB column to {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
