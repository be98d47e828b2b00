"""npu_pool compacting at iteration boundaries, on the device the torch model just fits (README.md here).

Run from the root of a checkout with ../shared beside it, boundaries.patch applied and the core
built, with the switch in the environment: ``NP_XCB=0 python benchmarks/results/sim-2026-11-28b/boundaries.py``
(unset: no compaction; 0: at every iteration boundary; K: at boundary K only). Per trace with
iterations: the physical calls (chunks created + released) over the run, the calls in its steady
iterations (as docs/device_calls.md counts them), the chunks compacted and the bytes moved.
"""
import os
import sys
from pathlib import Path

sys.path[:0] = [os.getcwd(), os.getcwd() + "/benchmarks"]
from fragmentation import collect, snapshots  # noqa: E402
from npu_pool.device_costs import physical_calls  # noqa: E402
from npu_pool.replay import iteration_bounds, min_capacity, run, steady_calls  # noqa: E402
from npu_pool.trace.files import open_traces  # noqa: E402


def main() -> None:
    named = [nt for p in snapshots(Path("../shared/traces")) for nt in open_traces(p)] + collect(Path("/nonexistent"), True)
    seen: set = set()
    for name, t in [(n, t) for n, t in named if not (n in seen or seen.add(n))]:
        bounds = iteration_bounds(t)
        if not bounds:
            continue
        device, _ = min_capacity(t, "torch")
        r = run(t, "npu_pool", device, bounds=bounds)
        steady = steady_calls(r.iteration_calls, r.iteration_peaks) if r.ok else "fails"
        print(f"{name:28s} physical {physical_calls(r.calls):5d}  steady {steady}  compactions {r.stats['compactions']}"
              f"  moved {r.stats['compacted'] >> 20} MiB", flush=True)


if __name__ == "__main__":
    main()
