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

``--snapshots``: instead, the import of each given PyTorch snapshot (or export), each read in a
fresh process both ways: ``streamed`` (``load_snapshot``: the file read range by range, each
entry converted and freed as it comes) and ``whole`` (the whole-file unpickle it replaced, still
its fallback for files it does not follow). Printed: the file's bytes; for each way, peak RSS
above the bare interpreter and the peak of the Python allocations (tracemalloc, a run apart),
against the file's size; seconds (best of ``--repeat`` runs, the two ways alternated; the whole
read's conversion is this tree's, which this change made faster). ``--before CHECKOUT`` also
times ``load_snapshot`` of another checkout (its core built) side by side.

Figures (2 shared cores, Python 3.11; `python benchmarks/io_memory.py --snapshots
../shared/traces/*.pickle --before <a checkout of 84ba63c, its core built>`): peak RSS above
the bare interpreter under the interpreter's own import peak streamed on all nine (whole: up to
1.8x the file), Python allocations 1.0-2.0x the file streamed, 3.0-4.5x whole; 1.34x the time of
84ba63c's import over the nine (1.0-2.0x each). `python benchmarks/io_memory.py --events
1000000`: the import of the 70 MB export needs 1.4x its size above the bare interpreter
streamed, 8.7x at 84ba63c.
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


_READ = """
import json, resource, sys, time
sys.path.insert(0, {root!r})
import npu_pool.cli, npu_pool.trace.snapshot as s, tracemalloc
from pathlib import Path
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
if {traced!r}:
    tracemalloc.start()
t0 = time.perf_counter()
if {mode!r} in ("streamed", "before"):  # before: load_snapshot of another checkout (--before)
    traces = s.load_snapshot({path!r})
else:  # the whole-file read: unpickled whole, then converted
    p = Path({path!r})
    with open(p, "rb") as f:
        s.check_head(p, f.read(8))
        f.seek(0)
        obj = s._unpickle(s._Bounded(f, p.stat().st_size), str(p))
    traces = s.snapshot_to_traces(obj, str(p), max_elements=p.stat().st_size, _consume=True)
print(json.dumps({{"seconds": time.perf_counter() - t0, "base": base, "events": sum(len(t) for t in traces),
                  "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "traced": tracemalloc.get_traced_memory()[1] if {traced!r} else 0}}))
"""


def read_snapshot(path: str, mode: str, traced: bool = False, root: Path = ROOT) -> dict:
    code = _READ.format(root=str(root), path=str(Path(path).resolve()), mode=mode, traced=traced)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT))
    if r.returncode:
        raise SystemExit(r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def snapshots(paths: list[str], repeat: int, before: Path | None = None) -> None:
    print("peak RSS above the bare interpreter (0: under the interpreter's own import peak) and peak of "
          "the Python allocations (tracemalloc, a run apart), each against the file's size; seconds")
    print(f"{'snapshot':34} {'bytes':>11} {'RSS streamed':>13} {'whole':>7} {'traced streamed':>16} {'whole':>7} "
          f"{'s streamed':>10} {'whole':>6} {'ratio':>6}")
    for p in paths:
        size = Path(p).stat().st_size
        runs: dict[str, list[dict]] = {"streamed": [], "whole": []}
        for _ in range(repeat):
            for mode in runs:
                runs[mode].append(read_snapshot(p, mode))
        assert runs["streamed"][0]["events"] == runs["whole"][0]["events"]
        above = {m: min(r["peak"] - r["base"] for r in rs) / size for m, rs in runs.items()}
        traced = {m: read_snapshot(p, m, traced=True)["traced"] / size for m in runs}
        secs = {m: min(r["seconds"] for r in rs) for m, rs in runs.items()}
        print(f"{Path(p).name:34} {size:11,} {above['streamed']:12.2f}x {above['whole']:6.2f}x "
              f"{traced['streamed']:15.2f}x {traced['whole']:6.2f}x {secs['streamed']:10.2f} {secs['whole']:6.2f} "
              f"{secs['streamed'] / secs['whole']:6.2f}")
    if before is None:
        return
    print(f"\nseconds against load_snapshot of {before} (best of {repeat}, alternated)")
    total = {"streamed": 0.0, "before": 0.0}
    for p in paths:
        secs = {"streamed": [], "before": []}
        for _ in range(repeat):
            secs["streamed"].append(read_snapshot(p, "streamed")["seconds"])
            secs["before"].append(read_snapshot(p, "before", root=before)["seconds"])
        best = {m: min(v) for m, v in secs.items()}
        for m in total:
            total[m] += best[m]
        print(f"{Path(p).name:34} {best['streamed']:8.3f} {best['before']:8.3f} "
              f"{best['streamed'] / best['before']:6.2f}")
    print(f"{'all':34} {total['streamed']:8.3f} {total['before']:8.3f} {total['streamed'] / total['before']:6.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=2_000_000)
    ap.add_argument("--keep", metavar="DIR", help="write the files here (default: a temporary folder)")
    ap.add_argument("--snapshots", nargs="+", metavar="PICKLE", help="measure the import of these snapshots instead")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each way per snapshot (--snapshots)")
    ap.add_argument("--before", type=Path, metavar="CHECKOUT",
                    help="with --snapshots: also time load_snapshot of this other checkout (its core built), "
                         "e.g. `git worktree add ../before 84ba63c`")
    args = ap.parse_args()
    if args.snapshots:
        snapshots(args.snapshots, args.repeat, args.before.resolve() if args.before else None)
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
