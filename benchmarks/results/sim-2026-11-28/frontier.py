"""npu_pool with compaction against #19's bounds, for one build of the arena (see README.md here).

Run from the root of a checkout with ../shared beside it, after building it, with the switches of
rules.patch in the environment: ``NP_XRULES=15 python benchmarks/results/sim-2026-11-28/frontier.py``
(``RULES=npu``: every replay under torch_npu's request rules, the torch model as its allocator).
Per trace: the minimum-capacity waste, the physical calls (chunks created + released) at that
capacity against the torch model's at its own, on the device the torch model just fits and given
room to spare, the steady calls given room and on that device, and what compaction copied at the
minimum capacity and on that device; then the totals.
"""
import os
import sys
from pathlib import Path

sys.path[:0] = [os.getcwd(), os.getcwd() + "/benchmarks"]
from fragmentation import collect, snapshots  # noqa: E402
from npu_pool.device_costs import physical_calls  # noqa: E402
from npu_pool.replay import evaluate, iteration_bounds, min_capacity, run, steady_calls  # noqa: E402
from npu_pool.trace.files import open_traces  # noqa: E402

MiB = 1 << 20
RULES = os.environ.get("RULES") or None  # None: each trace's own device's rules


def main() -> None:
    named = [nt for p in snapshots(Path("../shared/traces")) for nt in open_traces(p)] + collect(Path("/nonexistent"), True)
    seen: set = set()
    named = [(n, t) for n, t in named if not (n in seen or seen.add(n))]
    tot = dict(waste=0.0, physical_min=0, bound_min=0, bound_full=0, bound_room=0, steady_room=0, steady_full=0,
               repeating=0, moved_min_mib=0.0, moved_full_mib=0.0)
    for name, t in named:
        device, torch_min = min_capacity(t, "torch", device=RULES)
        torch_room = run(t, "torch", device=RULES)
        b = iteration_bounds(t)
        r = evaluate(t, name, "npu_pool", bounds=b, compact=True, device=RULES)
        full = run(t, "npu_pool", device, bounds=b, compact=True, device=RULES)
        waste = (r.min_capacity_bytes - r.peak_live_bytes) / MiB
        at_min, room = physical_calls(r.calls_at_min_capacity), physical_calls(r.calls)
        on_full = physical_calls(full.calls) if full.ok else None
        steady_full = steady_calls(full.iteration_calls, full.iteration_peaks) if full.ok else "fails"
        moved_min, moved_full = r.stats_at_min_capacity["compacted"] / MiB, full.stats["compacted"] / MiB
        print(f"{name:28s} waste {waste:6.1f} MiB  physical at min cap {at_min:5d} (torch {physical_calls(torch_min.calls):5d})"
              f"  full device {on_full if full.ok else 'fails'}  given room {room} (torch {physical_calls(torch_room.calls)})"
              f"  steady: room {r.steady_calls} full {steady_full}  moved MiB: min cap {moved_min:.0f} full {moved_full:.0f}",
              flush=True)
        tot["waste"] += waste
        tot["physical_min"] += at_min
        tot["bound_min"] += at_min <= physical_calls(torch_min.calls)
        tot["bound_full"] += on_full is not None and on_full <= physical_calls(torch_min.calls)
        tot["bound_room"] += room <= physical_calls(torch_room.calls)
        tot["moved_min_mib"] += moved_min
        tot["moved_full_mib"] += moved_full
        if r.steady_calls is not None:
            tot["repeating"] += 1
            tot["steady_room"] += r.steady_calls == 0
            tot["steady_full"] += steady_full == 0
    print(" ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in tot.items()))


if __name__ == "__main__":
    main()
