"""Device calls against minimum-capacity waste for one build of the arena (see README.md here).

Run from the root of a checkout with ../shared beside it, after building it, with the rules.patch
switches in the environment: ``NP_OFF=4 python benchmarks/results/sim-2026-11-26/frontier.py``.
The torch model's figures (the same in every build) are cached in $TMPDIR.
"""
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [os.getcwd(), os.getcwd() + "/benchmarks"]
from fragmentation import collect, snapshots  # noqa: E402
from npu_pool.replay import evaluate, iteration_bounds, run, steady_calls  # noqa: E402
from npu_pool.trace.files import open_traces  # noqa: E402

PHYS = ("malloc", "free", "phys_create", "phys_release")
MiB = 1 << 20


def phys(calls: dict) -> int:
    return sum(calls.get(k, 0) for k in PHYS)


def main() -> None:
    named = [nt for p in snapshots(Path("../shared/traces")) for nt in open_traces(p)] + collect(Path("/nonexistent"), True)
    seen: set = set()
    named = [(n, t) for n, t in named if not (n in seen or seen.add(n))]
    cache = Path(tempfile.gettempdir()) / "npu_pool_frontier_torch.json"
    torch = json.loads(cache.read_text()) if cache.is_file() else {}
    tot = dict(waste=0.0, peak_reserved_room=0.0, physical_min=0, bound_min=0, bound_full=0, bound_room=0, steady_room=0, steady_full=0, repeating=0)
    for name, t in named:
        if name not in torch or "room_phys" not in torch[name]:
            r = evaluate(t, name, "torch")
            torch[name] = {"min": r.min_capacity_bytes, "min_phys": phys(r.calls_at_min_capacity),
                           "room_phys": phys(r.calls)}
            cache.write_text(json.dumps(torch))
        b = iteration_bounds(t)
        r = evaluate(t, name, "npu_pool", bounds=b)
        waste = (r.min_capacity_bytes - r.peak_live_bytes) / MiB
        at_min = phys(r.calls_at_min_capacity)
        full = run(t, "npu_pool", torch[name]["min"], bounds=b)  # the device the torch model just fits
        full_steady = steady_calls(full.iteration_calls, full.iteration_peaks) if full.ok else "fails"
        print(f"{name:28s} waste {waste:6.1f} MiB  physical at min cap {at_min:5d} (torch {torch[name]['min_phys']:5d})"
              f"  full device {phys(full.calls) if full.ok else 'fails'}  steady: room {r.steady_calls} full {full_steady}"
              f"  given room {phys(r.calls)} (torch {torch[name]['room_phys']})", flush=True)
        tot["waste"] += waste
        tot["peak_reserved_room"] += r.peak_reserved_bytes / MiB  # given room to spare (1 TiB), MiB
        tot["physical_min"] += at_min
        tot["bound_min"] += at_min <= torch[name]["min_phys"]
        tot["bound_full"] += full.ok and phys(full.calls) <= torch[name]["min_phys"]
        tot["bound_room"] += phys(r.calls) <= torch[name]["room_phys"]
        if r.steady_calls is not None:
            tot["repeating"] += 1
            tot["steady_room"] += r.steady_calls == 0
            tot["steady_full"] += full_steady == 0
    print(" ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in tot.items()))


if __name__ == "__main__":
    main()
