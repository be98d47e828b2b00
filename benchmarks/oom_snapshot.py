"""Time from a failing request to its exception, with OOM snapshots on and off.

A simulated pool keeps the history an installed pool keeps with snapshots on
(``oom.HISTORY_WHEN_ENABLED`` events), runs ``--pairs`` alloc/free pairs, then asks for more
than the device holds. Printed per setting: the median and max over ``--repeat`` failures of
the time ``Pool.malloc`` takes to raise, and the bytes the snapshot files take.

    python benchmarks/oom_snapshot.py [--pairs 300000] [--repeat 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from npu_pool import oom  # noqa: E402
from npu_pool.pool import OutOfMemoryError, Pool  # noqa: E402

MiB = 1 << 20


def one_failure(pool: Pool) -> float:
    t0 = time.perf_counter()
    try:
        pool.malloc(1 << 40)
    except OutOfMemoryError:
        return time.perf_counter() - t0
    raise AssertionError("the request was served")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=300_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    pool = Pool("npu_pool", capacity=1 << 30)
    pool.set_history(oom.HISTORY_WHEN_ENABLED)
    keep = [pool.malloc(MiB) for _ in range(16)]
    for _ in range(args.pairs):
        pool.free(pool.malloc(4096))
    print(f"history kept: {len(pool.history(oom.HISTORY_WHEN_ENABLED))} events ({args.pairs} alloc/free pairs); "
          f"{len(keep)} live blocks")
    with tempfile.TemporaryDirectory() as d:
        for label, env in (("snapshots off", None), ("snapshots on", d)):
            if env is None:
                os.environ.pop(oom.ENV, None)
            else:
                os.environ[oom.ENV] = env
            times = [one_failure(pool) for _ in range(args.repeat)]
            files = list(Path(d).iterdir())
            size = sum(f.stat().st_size for f in files)
            print(f"{label:14}: request -> exception median {statistics.median(times) * 1e3:9.2f} ms, "
                  f"max {max(times) * 1e3:9.2f} ms; {len(files)} files, {size / len(files) if files else 0:,.0f} "
                  f"bytes per file")
            for f in files:
                f.unlink()
    os.environ.pop(oom.ENV, None)


if __name__ == "__main__":
    main()
