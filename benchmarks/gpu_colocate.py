"""Colocated RL on a real device: a trainer and a rollout take turns on one device, once with
npu_pool's pause/resume and once with the stock offload (copy to host, free, ``empty_cache``,
copy back), each allocator in its own process.

    python benchmarks/gpu_colocate.py [--device cuda|npu] [--cycles 5] [--dim 1024] [--layers 8]
                                      [--kv-ratio 1.0] [--margin-mib 512] [--no-train] [--json FILE]
    python benchmarks/gpu_colocate.py --report FILE    # the table of a saved --json file

The trainer (``npu_pool.workloads.gpt`` and AdamW, trained two steps first) is built inside
``npu_pool.region("train")``. Raw driver memory (``cuMemAlloc`` / ``aclrtMalloc``, outside both
allocators: another process's share) then fills the device until, beside the trainer, it has
room for half of a KV cache of ``--kv-ratio`` times the trainer's bytes or for a training step's
own peak, whichever is more (and ``--margin-mib`` for the kernels' workspaces): the trainer and
the KV cache cannot both be on it. Each cycle: offload the trainer (``pause("train",
backup=True)``; native: every parameter and optimizer state ``.to("cpu", non_blocking=True)``, as
verl's offload does; then ``empty_cache`` under both, as verl calls it), run the rollout (the KV
cache: created in ``region("kv_cache")`` in the first cycle, ``resume("kv_cache")`` in later ones,
written, then ``pause("kv_cache")``; native: ``torch.empty``, written, freed, ``empty_cache``),
load the trainer back (``resume("train")``; native: ``.to(device)``) and train one step.

Checked, per cycle: the trainer's contents after the load equal what it held before the offload
(byte for byte, on the host), its tensors' addresses (npu_pool keeps them; the stock offload
does not), the losses of the two allocators step by step (same seeds, deterministic kernels), the
device's free memory after the offload (``mem_get_info``) and that the trainer and the KV cache
could not both be allocated. Measured: the offload, rollout and load times of each cycle (the
medians from the second cycle on, and their ratios, side by side in one run), peak reserved.
``--no-train`` skips every kernel (copies only: the fake CANN runtime, which runs none, checks
this script). Exits 2 when the device is not usable, 1 when a check fails.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from gpu_check import run_worker  # (beside this script)

MODES = ("npu_pool", "native")


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "npu"))
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--kv-ratio", type=float, default=1.0, help="the KV cache's bytes over the trainer's")
    ap.add_argument("--margin-mib", type=int, default=512,
                    help="free memory left beyond half the KV cache or a step's peak (kernels' workspaces)")
    ap.add_argument("--no-train", action="store_true", help="no kernels: copies only (checks this script)")
    ap.add_argument("--json", default=None, help="write both runs' figures here")
    ap.add_argument("--report", default=None, metavar="JSON",
                    help="print the table of a run's --json file instead of running (no device)")
    ap.add_argument("--worker", default=None, choices=MODES, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.cycles < 2:
        ap.error("--cycles must be at least 2 (the medians leave the first cycle out)")
    if not 0 < a.kv_ratio <= 4:
        ap.error("--kv-ratio must be in (0, 4]")
    return a


class _Raw:
    """Device memory taken from the driver itself, outside torch's allocator and npu_pool."""

    def __init__(self, device: str) -> None:
        self.npu = device == "npu"
        if self.npu:
            self.lib = ctypes.CDLL("libascendcl.so")
            self.lib.aclrtMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int]
            self.lib.aclrtFree.argtypes = [ctypes.c_void_p]
        else:
            self.lib = ctypes.CDLL("libcuda.so.1")  # the current context is torch's primary one
            self.lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
            self.lib.cuMemFree_v2.argtypes = [ctypes.c_uint64]

    def alloc(self, size: int) -> int:
        """The address of `size` bytes, or 0 when the device refuses them."""
        if self.npu:
            p = ctypes.c_void_p()
            return int(p.value or 0) if self.lib.aclrtMalloc(ctypes.byref(p), size, 0) == 0 else 0
        q = ctypes.c_uint64()
        return int(q.value) if self.lib.cuMemAlloc_v2(ctypes.byref(q), size) == 0 else 0

    def free(self, addr: int) -> None:
        if self.npu:
            self.lib.aclrtFree(ctypes.c_void_p(addr))
        else:
            self.lib.cuMemFree_v2(ctypes.c_uint64(addr))


def _worker(a: argparse.Namespace) -> dict[str, Any]:
    pool = None
    if a.worker == "npu_pool":
        import npu_pool  # installed before torch touches the device

        pool = npu_pool.install(device_type=a.device)[0]
    import torch

    if a.device == "npu":
        import torch_npu  # noqa: F401
    from npu_pool.live import is_oom
    from npu_pool.workloads.gpt import GPT, make_config

    acc = getattr(torch, a.device)
    dev = torch.device(a.device, 0)
    acc.set_device(dev)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    if a.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    gen = torch.Generator().manual_seed(1)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    attention = lambda: sdpa_kernel([SDPBackend.MATH])  # noqa: E731 (deterministic)
    region = npu_pool.region if pool else (lambda tag: contextlib.nullcontext())
    with region("train"):
        model = GPT(make_config("gpt", dim=a.dim, n_layers=a.layers, n_heads=8, vocab=a.vocab, max_seq=a.seq)).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> float:
        batch = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=gen)
        with region("train"), attention():  # the update's states and gradients join the tag
            loss = model(batch[:, :-1].to(dev), batch[:, 1:].to(dev))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return float(loss.item())

    losses = [] if a.no_train else [step(), step()]

    def trainer() -> list[torch.Tensor]:  # every tensor the trainer keeps: weights, optimizer states
        out = [p.data for p in model.parameters()]
        for st in opt.state.values():
            out += [v for v in st.values() if isinstance(v, torch.Tensor) and v.device.type == a.device]
        return out

    acc.synchronize()
    acc.empty_cache()
    live = sum(t.numel() * t.element_size() for t in trainer())
    kv_bytes = int(live * a.kv_ratio) // 512 * 512
    raw = _Raw(a.device)
    free0, total = acc.mem_get_info()
    step_extra = max(0, acc.max_memory_allocated() - live)  # gradients, optimizer temporaries, activations
    ballast_bytes = free0 - (max(kv_bytes // 2, step_extra) + (a.margin_mib << 20))
    ballast = raw.alloc(ballast_bytes) if ballast_bytes > 0 else 0
    if ballast_bytes > 0 and not ballast:
        raise SystemExit(f"the driver refused {ballast_bytes} bytes of ballast with {free0} free")

    def kv_alloc() -> torch.Tensor:
        return torch.empty(kv_bytes, dtype=torch.uint8, device=dev)

    try:  # the trainer and the KV cache do not both fit
        with region("kv_cache"):
            probe = kv_alloc()
        both_fit = True
        del probe
    except (RuntimeError, MemoryError) as e:
        if not is_oom(e):
            raise
        both_fit = False
    acc.synchronize()
    acc.empty_cache()

    def snap() -> list[torch.Tensor]:
        return [t.cpu() for t in trainer()]

    offloaded: list[tuple[dict, str]] = []  # the optimizer states the stock offload moved

    def offload() -> None:
        if pool:
            npu_pool.pause("train", backup=True)
            acc.empty_cache()  # as verl's offload calls it, whatever the allocator
            return
        for p in model.parameters():
            p.data = p.data.to("cpu", non_blocking=True)
        for st in opt.state.values():
            for k, v in list(st.items()):
                if isinstance(v, torch.Tensor) and v.device.type == a.device:
                    st[k] = v.to("cpu", non_blocking=True)
                    offloaded.append((st, k))
        acc.synchronize()
        acc.empty_cache()

    def load() -> None:
        if pool:
            npu_pool.resume("train")
            return
        for p in model.parameters():
            p.data = p.data.to(dev, non_blocking=True)
        for st, k in offloaded:
            st[k] = st[k].to(dev, non_blocking=True)
        offloaded.clear()
        acc.synchronize()

    kv: list[torch.Tensor] = []
    pattern = torch.arange(1 << 20, dtype=torch.int32).remainder(251).to(torch.uint8)

    def rollout(c: int) -> None:
        if pool and kv:
            npu_pool.resume("kv_cache")
        else:
            with region("kv_cache"):
                kv.append(kv_alloc())
        if a.no_train:
            kv[0][: pattern.numel()].copy_(pattern)
        else:
            kv[0].fill_(c % 251)
            kv[0][: pattern.numel()].copy_(pattern)
        acc.synchronize()
        if pool:
            npu_pool.pause("kv_cache")
        else:
            kv.clear()
            acc.empty_cache()

    cycles = []
    for c in range(a.cycles):
        before = snap()
        ptrs = [t.data_ptr() for t in trainer()]
        acc.synchronize()
        t0 = time.perf_counter()
        offload()
        t1 = time.perf_counter()
        free_off = acc.mem_get_info()[0]
        rollout(c)
        acc.synchronize()
        t2 = time.perf_counter()
        load()
        acc.synchronize()
        t3 = time.perf_counter()
        after = trainer()
        same = len(after) == len(before) and all(torch.equal(x.cpu(), y) for x, y in zip(after, before))
        moved, n = sum(1 for t, p in zip(after, ptrs) if t.data_ptr() != p), len(after)
        del after, before  # (a reference kept would keep the stock offload's device copy)
        loss = None if a.no_train else step()
        cycles.append({"offload_s": t1 - t0, "rollout_s": t2 - t1, "load_s": t3 - t2, "contents_same": same,
                       "tensors_moved": moved, "tensors": n, "free_after_offload": free_off,
                       "reserved": acc.memory_reserved(), "loss": loss})
    if ballast:
        raw.free(ballast)
    res = {"losses": losses + [c["loss"] for c in cycles if c["loss"] is not None], "cycles": cycles,
           "trainer_bytes": live, "kv_bytes": kv_bytes, "step_extra": step_extra,
           "ballast_bytes": max(ballast_bytes, 0), "total": total, "both_fit": both_fit,
           "peak_reserved": acc.max_memory_reserved(), "device": acc.get_device_name(0)}
    if pool:
        res["calls"] = {k: v for k, v in pool.stats()["calls"].items() if v}
        pool.check()
    return res


def _unusable(device: str) -> str:
    """Why the device cannot run this script ('' when it can), asked without allocating on it."""
    try:
        import torch

        if device == "npu":
            import torch_npu  # noqa: F401
        if getattr(torch, device).is_available():
            return ""
    except ImportError as e:
        return f"torch cannot reach a {device} device here ({e})"
    return f"no usable {device} device (torch.{device}.is_available() is False)"


def median_ms(res: dict[str, Any], key: str) -> float:
    """The median of `key` (seconds) over the cycles after the first, in milliseconds."""
    return statistics.median(c[key] for c in res["cycles"][1:]) * 1e3


def report(res: dict[str, dict[str, Any]]) -> tuple[str, bool]:
    """A markdown table of both runs, and whether every check passed."""
    p, n = res["npu_pool"], res["native"]
    mib = 1 << 20
    rows = [("trainer bytes (weights + optimizer states)", p["trainer_bytes"], n["trainer_bytes"]),
            ("trainer and KV cache both fit", p["both_fit"], n["both_fit"]),
            ("contents equal after every load", all(c["contents_same"] for c in p["cycles"]),
             all(c["contents_same"] for c in n["cycles"])),
            ("trainer tensors moved by a cycle (of %d)" % p["cycles"][0]["tensors"],
             max(c["tensors_moved"] for c in p["cycles"]), max(c["tensors_moved"] for c in n["cycles"])),
            ("free after the offload, first / last cycle (MiB)",
             "%d / %d" % (p["cycles"][0]["free_after_offload"] // mib, p["cycles"][-1]["free_after_offload"] // mib),
             "%d / %d" % (n["cycles"][0]["free_after_offload"] // mib, n["cycles"][-1]["free_after_offload"] // mib)),
            ("reserved after a cycle, first / last (MiB)",
             "%d / %d" % (p["cycles"][0]["reserved"] // mib, p["cycles"][-1]["reserved"] // mib),
             "%d / %d" % (n["cycles"][0]["reserved"] // mib, n["cycles"][-1]["reserved"] // mib)),
            ("peak reserved (bytes)", p["peak_reserved"], n["peak_reserved"])]
    for key in ("offload_s", "rollout_s", "load_s"):
        pm, nm = median_ms(p, key), median_ms(n, key)
        name = f"{key[:-2]} median from cycle 2 (ms; npu_pool / native {pm / nm:.2f}x)"
        rows.append((name, f"{pm:.1f}", f"{nm:.1f}"))
    same_losses = p["losses"] == n["losses"]
    rows.append(("losses equal step by step (%d steps)" % len(p["losses"]), same_losses, same_losses))
    lines = ["| | npu_pool (pause / resume) | native (offload / reload) |", "|---|---:|---:|"]
    lines += [f"| {name} | {x} | {y} |" for name, x, y in rows]
    ok = (same_losses and not p["both_fit"] and not n["both_fit"]
          and all(c["contents_same"] for r in (p, n) for c in r["cycles"])
          and max(c["tensors_moved"] for c in p["cycles"]) == 0)
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    if a.worker:
        print("RESULT " + json.dumps(_worker(a)), flush=True)
        return 0
    if a.report:
        try:
            res = json.loads(Path(a.report).read_text())
            table, ok = report(res)
            head = f"device: {res['npu_pool']['device']}; {len(res['npu_pool']['cycles'])} cycles"
        except (OSError, ValueError, KeyError, TypeError, IndexError, statistics.StatisticsError) as e:
            print(f"gpu_colocate: {a.report} is not a --json file of this script ({type(e).__name__}: {e})",
                  file=sys.stderr)
            return 2
    else:
        why = _unusable(a.device)
        if why:
            print(f"gpu_colocate: {why}", file=sys.stderr)
            return 2
        argv = list(argv if argv is not None else sys.argv[1:])
        res = {m: run_worker(m, argv, __file__) for m in MODES}
        table, ok = report(res)
        head = f"device: {res['npu_pool']['device']}; {a.cycles} cycles"
    print(head)
    print(table)
    if "calls" in res["npu_pool"]:
        print("npu_pool's device calls: " + ", ".join(f"{k} {v}" for k, v in res["npu_pool"]["calls"].items()))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    print("checks: " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
