"""Micro-benchmark: nanoseconds per malloc+free pair for each policy.

    python benchmarks/micro.py [--pairs 200000]

Two measurements side by side in one run: the C loop (a synthetic trace replayed by
np_replay, no Python per call) and the Python API (one cffi call per malloc and per
free). The workload keeps a working set of live blocks of mixed sizes so the free
trees are not trivially empty.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from npu_pool import Pool, replay  # noqa: E402
from npu_pool.trace.format import OP_ALLOC, OP_FREE, Trace  # noqa: E402

POLICIES = ["torch", "expandable", "npu_pool"]


def workload(pairs: int, live: int = 256, seed: int = 0) -> Trace:
    rng = random.Random(seed)
    t = Trace(meta={"origin": "micro"})
    held: list[tuple[int, int]] = []
    nid = 0
    for _ in range(pairs):
        size = rng.choice([rng.randint(1, 8192), rng.randint(8192, 1 << 20), rng.randint(1 << 20, 32 << 20)])
        t.append(OP_ALLOC, id=nid, size=size)
        held.append((nid, size))
        nid += 1
        if len(held) > live:
            i, s = held.pop(rng.randrange(len(held)))
            t.append(OP_FREE, id=i, size=s)
    for i, s in held:
        t.append(OP_FREE, id=i, size=s)
    t.meta["n_ids"] = nid
    return t


def python_api(trace: Trace, policy: str) -> float:
    ptrs: dict[int, int] = {}
    with Pool(policy, capacity=replay.UNLIMITED) as pool:
        malloc, free = pool.malloc, pool.free
        t0 = time.perf_counter_ns()
        for op, id_, size in zip(trace.op, trace.id, trace.size):
            if op == OP_ALLOC:
                ptrs[id_] = malloc(size)
            else:
                free(ptrs.pop(id_))
        return (time.perf_counter_ns() - t0) / (len(trace) / 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=200_000)
    args = ap.parse_args()
    trace = workload(args.pairs)
    print(f"{args.pairs} malloc+free pairs, ~256 live blocks of 1 B - 32 MiB")
    print(f"| policy | C loop ns/pair | Python API ns/pair |")
    print(f"|---|---:|---:|")
    for policy in POLICIES:
        r = replay.run(trace, policy)
        print(f"| {policy} | {r.ns / (r.ops / 2):.0f} | {python_api(trace, policy):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
