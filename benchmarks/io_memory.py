"""Peak memory and time of `export` and `import` against the size of their input, with
`replay` beside them, on a generated trace.

A synthetic trace of ``--events`` events (allocations and frees of mixed sizes, at most a few
thousand live, sites and markers) is written as an .npt; then, each in a fresh process:
``replay`` of the .npt (one policy, no capacity search), ``export`` of the .npt (replayed under
npu_pool) and ``import`` of that export. Printed per command: input bytes, peak RSS (the
process's high-water mark, ``ru_maxrss``) and peak RSS above a bare interpreter that imported
the package, their ratios to the input, and seconds.

    python benchmarks/io_memory.py [--events 2000000] [--keep DIR]
    python benchmarks/io_memory.py --snapshots ../shared/traces/*.pickle   # import of real snapshots

``--snapshots``: instead, the import of each given PyTorch snapshot in this process: its
peak Python-side memory (tracemalloc) against the file's size, and seconds.
"""
from __future__ import annotations

import argparse
import array
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from npu_pool.trace.format import MARK_ITER_BEGIN, OP_ALLOC, OP_FREE, OP_MARK, Trace  # noqa: E402

MiB = 1 << 20


def synthetic(n: int, seed: int = 0, live_max: int = 3000) -> Trace:
    """``n`` events: allocations (1 B .. 64 MiB) and frees, at most ``live_max`` live, 200 sites,
    an iteration marker every 10000 events."""
    rng = random.Random(seed)
    cols = {c: array.array(code) for c, code in (("op", "B"), ("cat", "B"), ("site", "i"), ("id", "q"),
                                                    ("size", "Q"), ("stream", "q"), ("addr", "Q"))}
    live: list[tuple[int, int, int]] = []
    next_id = 0

    def put(op: int, cat: int, site: int, id_: int, size: int) -> None:
        for c, v in (("op", op), ("cat", cat), ("site", site), ("id", id_), ("size", size), ("stream", 0),
                     ("addr", 0)):
            cols[c].append(v)

    for i in range(n):
        if i % 10_000 == 0:
            put(OP_MARK, MARK_ITER_BEGIN, -1, i // 10_000, 0)
        elif live and (len(live) >= live_max or rng.random() < 0.5):
            id_, size, site = live.pop(rng.randrange(len(live)))
            put(OP_FREE, 0, site, id_, size)
        else:
            size = rng.choice((rng.randint(1, 4096), rng.randint(4096, 2 * MiB), rng.randint(2 * MiB, 64 * MiB)))
            site = rng.randrange(200)
            put(OP_ALLOC, 0, site, next_id, size)
            live.append((next_id, size, site))
            next_id += 1
    t = Trace(meta={"origin": "synthetic", "n_ids": next_id, "device": 0,
                    "sites": [f"model/layer{k % 24}.py:{10 + k}:forward" for k in range(200)]}, **cols)
    t.validate()
    return t


_MEASURE = """
import json, resource, sys, time
sys.path.insert(0, {root!r})
import npu_pool.cli, npu_pool.trace, npu_pool.replay, npu_pool.analysis.memviz, npu_pool.trace.snapshot
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t0 = time.perf_counter()
rc = npu_pool.cli.main({argv!r}) if {argv!r} else 0
print(json.dumps({{"rc": rc, "seconds": time.perf_counter() - t0, "base": base,
                  "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}}))
"""


def measure(argv: list[str]) -> dict:
    r = subprocess.run([sys.executable, "-c", _MEASURE.format(root=str(ROOT), argv=argv)], capture_output=True,
                       text=True, cwd=str(ROOT))
    if r.returncode:
        raise SystemExit(r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def snapshots(paths: list[str]) -> None:
    import tracemalloc

    from npu_pool.trace.snapshot import load_snapshot

    print(f"{'snapshot':40} {'bytes':>12} {'peak traced':>12} {'ratio':>6} {'seconds':>8}")
    for p in paths:
        size = Path(p).stat().st_size
        tracemalloc.start()
        t0 = time.perf_counter()
        load_snapshot(p)
        took = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        print(f"{Path(p).name:40} {size:12,} {peak:12,} {peak / size:6.1f} {took:8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=2_000_000)
    ap.add_argument("--keep", metavar="DIR", help="write the files here (default: a temporary folder)")
    ap.add_argument("--snapshots", nargs="+", metavar="PICKLE", help="measure the import of these snapshots instead")
    args = ap.parse_args()
    if args.snapshots:
        snapshots(args.snapshots)
        return
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(args.keep or tmp)
        d.mkdir(parents=True, exist_ok=True)
        npt, exported, imported = d / "big.npt", d / "big.pickle", d / "imported"
        t0 = time.perf_counter()
        synthetic(args.events).save(npt)
        print(f"generated {npt.name}: {args.events} events, {npt.stat().st_size:,} bytes "
              f"({time.perf_counter() - t0:.1f} s)")
        bare = measure([])
        rows = [("replay", npt, ["replay", str(npt), "--policy", "npu_pool", "--no-min-capacity"]),
                ("export", npt, ["export", str(npt), "--policy", "npu_pool", "--out", str(exported)]),
                ("import", exported, ["import", str(exported), "--out", str(imported)])]
        print(f"bare interpreter with the package imported: peak RSS {bare['peak']:,} bytes")
        print(f"{'command':8} {'input bytes':>13} {'peak RSS':>14} {'RSS/input':>9} {'above bare':>14} "
              f"{'above/input':>11} {'seconds':>8}")
        for name, src, argv in rows:
            m = measure(argv)
            size = src.stat().st_size
            above = m["peak"] - bare["peak"]
            print(f"{name:8} {size:13,} {m['peak']:14,} {m['peak'] / size:9.2f} {above:14,} {above / size:11.2f} "
                  f"{m['seconds']:8.1f}")


if __name__ == "__main__":
    main()
