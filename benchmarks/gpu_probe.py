"""Probe the allocators on a GPU with a trace: does torch's own caching allocator fit at given caps,
where does it put its segments (docs/gpu.md, "What the GPU found"), and what does each allocator
ask of the device in every iteration on a full device (docs/gpu.md, "A full device").

    python benchmarks/gpu_probe.py fits TRACE CAP_MIB[,CAP_MIB...]     # on a GPU
    python benchmarks/gpu_probe.py record TRACE CAP_MIB OUT.pickle      # on a GPU (CAP_MIB 0: no cap)
    python benchmarks/gpu_probe.py order SNAPSHOT.pickle...             # anywhere
    python benchmarks/gpu_probe.py steady TRACE ALLOCATOR [--cap-mib N] [--repeat 3] [--device cuda]

``fits`` plays the trace (.npt or .pickle) as tensors once with room to spare, then once under
each cap (``torch.cuda.set_per_process_memory_fraction`` of exactly CAP_MIB MiB, as
``npu-pool replay --live`` bisects it) and prints one JSON line per cap. ``record`` plays it once
under the cap with ``torch.cuda.memory._record_memory_history`` on and dumps the snapshot.
``order`` reads snapshots and counts, for each segment allocated while others were live, whether
it landed below all of them, above all of them, or between.

``steady`` plays the trace under one allocator (``native`` or ``npu_pool``, one process each: a
process chooses its allocator once) capped at CAP_MIB, by default at the torch model's minimum
capacity under the device's rules (the device the torch model just fits, as docs/device_calls.md's
"Steady iterations there"), ``--repeat`` times, each play as a first run, after one play with room
to spare (as ``npu-pool replay --live`` plays before it bisects: the device's address space then is
the one the torch model was checked against). It prints one JSON line: per iteration (the
stretches between ``replay.iteration_bounds``, the set-up first, the last up to
``replay.iterations_end``) the device calls the allocator
made in the first play (npu_pool: its memory calls by kind, less the address reservation;
native: the framework's num_device_alloc and num_device_free, as malloc and free), the wall
seconds of each play (synchronised at each bound), and the simulator's calls for the same
stretches (the torch model for native, the npu_pool policy for npu_pool, capped by the same memory
fraction of the same device: ``simulate_capped``).
``--device npu`` runs it under torch_npu (the tests' fake CANN: calls, not times).
"""
from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MiB = 1 << 20


def _trace(path: str) -> Any:
    from npu_pool.trace.files import open_traces

    (_, trace), *_ = open_traces(Path(path))
    return trace


def _player(path: str) -> tuple[Any, Any]:
    import torch

    from npu_pool.live import Player  # (the live replay's own player, as it plays)

    torch.cuda.set_device(0)
    return torch, Player(_trace(path), torch, torch.cuda, "cuda", None)


def steady(path: str, allocator: str, cap_mib: int | None, repeat: int, device: str) -> dict[str, Any]:
    """The calls and wall time of each iteration under ``allocator`` at a cap (see the module doc)."""
    from npu_pool.live import MEMORY_KINDS, Player
    from npu_pool.replay import iteration_bounds, iterations_end, min_capacity

    trace = _trace(path)
    bounds = iteration_bounds(trace)
    if not bounds:
        raise SystemExit(f"{path}: no iterations (no iteration markers, no period)")
    end = iterations_end(trace, bounds)  # (the teardown after it: no stretch, as the simulator counts)
    cuts = bounds + ([end] if end is not None else [])
    rules = "npu" if device == "npu" else "cuda"
    cap = cap_mib * MiB if cap_mib else min_capacity(trace, "torch", device=rules)[0]
    pool = None
    if allocator == "npu_pool":  # before the framework's own allocator serves anything
        from npu_pool.install import install

        pool = install(rules).get(0)
    import torch

    if device == "npu":
        import torch_npu  # noqa: F401  (registers torch.npu)
    module = getattr(torch, device)
    module.set_device(0)
    player = Player(trace, torch, module, device, pool)

    # the memory calls by kind, less the address reservation (kept over the warm-up's play)
    kinds = [k for k in MEMORY_KINDS if k not in ("reserve", "release")]

    def calls() -> dict[str, int]:
        if pool is not None:
            c = pool.stats()["calls"]
            return {k: int(c[k]) for k in kinds}
        st = module.memory_stats(player.dev)
        return {"malloc": int(st.get("num_device_alloc", 0)), "free": int(st.get("num_device_free", 0))}

    player.play()  # as the live replay's minimum-capacity search: a play with room to spare first
    player.cap(cap)
    plays: list[list[tuple[float, dict[str, int]]]] = []
    failed = None

    def mark(_k: int) -> None:  # at a bound: the time and the calls so far, the device idle
        module.synchronize()
        plays[-1].append((time.perf_counter(), calls()))

    for _ in range(repeat):
        player.reset()
        plays.append([])
        mark(-1)
        failed = player.play(cuts, mark)  # (play synchronises at its end)
        mark(len(cuts))
        if failed is not None:
            break
    player.cap(None)
    first = plays[0]
    live = [{k: b[1][k] - a[1][k] for k in b[1] if b[1][k] != a[1][k]} for a, b in zip(first, first[1:])][:len(bounds) + 1]
    seconds = [[round(b[0] - a[0], 6) for a, b in zip(p, p[1:])][:len(bounds) + 1] for p in plays]
    sim_ok, simulated = simulate_capped(trace, allocator, cap, player.total(), rules, bounds)
    return {"trace": Path(path).name, "allocator": allocator, "device": device, "cap_bytes": cap,
            "ok": failed is None, "fail": failed, "sim_ok": sim_ok, "iteration_calls": live,
            "simulated_calls": simulated, "same": live == simulated, "seconds": seconds}


def simulate_capped(trace: Any, allocator: str, cap: int, total: int, rules: str,
                    bounds: list[int]) -> tuple[bool, list[dict[str, int]]]:
    """The simulator's side of ``steady``: whether the model of ``allocator`` runs the trace, and its
    device calls in each stretch, on a ``total``-byte device capped at ``cap`` bytes by a memory
    fraction as the live play is (a framework's allocator then refuses past the cap without asking
    the device; on a device of ``cap`` bytes it would ask and be refused, calls the framework's
    counters leave out). Kinds as the live side counts them (no address reservation; native: the
    segment mallocs and frees)."""
    from npu_pool.live import MEMORY_KINDS, SIMULATED, cap_fraction
    from npu_pool.replay import run

    kinds = [k for k in MEMORY_KINDS if k not in ("reserve", "release")]
    if allocator == "native":  # the torch model's segments are the framework's device allocations
        kinds = ["malloc", "free"]
    total = max(total, cap)
    sim = run(trace, SIMULATED[allocator], total, device=rules, bounds=bounds, fraction=cap_fraction(cap, total))
    return sim.ok, [{k: d[k] for k in kinds if d.get(k)} for d in sim.iteration_calls or []]


def order(snapshots: list[str]) -> None:
    for path in snapshots:
        with open(path, "rb") as f:
            snap = pickle.load(f)  # (your own recordings: pickle runs what a file says)
        live: set[int] = set()
        below = above = between = 0
        for e in snap["device_traces"][0]:
            if e["action"] == "segment_alloc":
                if live:
                    below += e["addr"] < min(live)
                    above += e["addr"] > max(live)
                    between += min(live) < e["addr"] < max(live)
                live.add(e["addr"])
            elif e["action"] == "segment_free":
                live.discard(e["addr"])
        print(json.dumps({"snapshot": Path(path).name, "below_all": below, "above_all": above, "between": between}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    f = sub.add_parser("fits")
    f.add_argument("trace")
    f.add_argument("caps", help="MiB, comma separated")
    r = sub.add_parser("record")
    r.add_argument("trace")
    r.add_argument("cap", type=int, help="MiB (0: no cap)")
    r.add_argument("out")
    o = sub.add_parser("order")
    o.add_argument("snapshots", nargs="+")
    s = sub.add_parser("steady")
    s.add_argument("trace")
    s.add_argument("allocator", choices=("native", "npu_pool"))
    s.add_argument("--cap-mib", type=int, default=None, help="default: the torch model's minimum capacity")
    s.add_argument("--repeat", type=int, default=3)
    s.add_argument("--device", choices=("cuda", "npu"), default="cuda")
    args = ap.parse_args(argv)
    if args.mode == "order":
        order(args.snapshots)
        return 0
    if args.mode == "steady":
        if args.repeat < 1 or (args.cap_mib is not None and args.cap_mib < 1):
            ap.error("--repeat and --cap-mib take a positive number")
        print(json.dumps(steady(args.trace, args.allocator, args.cap_mib, args.repeat, args.device)))
        return 0
    torch, player = _player(args.trace)
    if args.mode == "fits":
        player.play()
        player.reset()  # as the live replay: a room-to-spare play first
        for mib in (int(c) for c in args.caps.split(",")):
            player.cap(mib * MiB if mib else None)
            player.reset()
            failed = player.play()
            player.reset()
            print(json.dumps({"trace": args.trace, "cap_mib": mib, "ok": failed is None, "fail": failed}))
        player.cap(None)
    else:
        player.cap(args.cap * MiB if args.cap else None)
        torch.cuda.memory._record_memory_history(max_entries=10**6, context=None, stacks="python")
        failed = player.play()
        torch.cuda.memory._dump_snapshot(args.out)
        print(json.dumps({"trace": args.trace, "cap_mib": args.cap, "ok": failed is None, "fail": failed}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
