"""Hold the simulator to the live torch_npu on every trace: ``python benchmarks/live_audit.py``.

Each trace (default: ../shared/traces and benchmarks/traces) is played live inside the real
torch_npu 2.13.0 over the fake CANN runtime of tests/fake_vendor (built here), once under
torch_npu's own caching allocator and once under npu_pool, with the minimum-capacity search
(``npu_pool.live.replay_live``); the simulator replays the same trace under torch_npu's request
rules (``--device npu``). Written to docs/live.md (``--doc``): per trace and allocator, every
figure both ways (peak reserved and allocated, minimum capacity, device allocations and frees,
and the fake runtime's count of each memory call, synchronisation, event call and stream query
against the simulator's count of that kind).

Needs the torch_npu venv ``./run test`` makes (.venv-torch-npu; ``--python`` another) and a C
compiler. The live npu_pool creates its pool inside the play, so the calls of its creation fall
in the live counts (the simulator counts from after its pool's creation: they are added to its
figure), and so does the player's final synchronisation (taken out of the live one).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "fake_vendor")]

import cann  # noqa: E402  (tests/fake_vendor)

from npu_pool.live import COUNTED_KINDS, SIMULATED, LiveError, replay_live  # noqa: E402
from npu_pool.replay import min_capacity, run  # noqa: E402
from npu_pool.trace.files import open_traces  # noqa: E402
from npu_pool.vocab import CALL_VENDOR  # noqa: E402

ACL = CALL_VENDOR["acl"]
FAKE_CAPACITY = 64 << 30  # the fake device: room to spare for every trace here
def _creation_calls() -> dict[str, int]:
    """The calls a new npu_pool pool makes on its device before its first request (the probe
    reservation, the device's size and granularity): the live pool is created inside the play,
    where the fake counts them; the simulator counts a replay's calls from after its pool's
    creation."""
    from npu_pool import Pool

    with Pool("npu_pool", capacity=FAKE_CAPACITY, rules="npu") as pool:
        return dict(pool.stats()["calls"])


def _kind_counts(r, sim_calls: dict[str, int], creation: dict[str, int]) -> list[tuple[str, int, int]]:
    """(kind, live, simulated) for every counted kind either side made: the simulated count with
    npu_pool's creation calls added for its row, the live one less the player's own final
    synchronisation."""
    out = []
    for k in COUNTED_KINDS:
        live = r.vendor_calls[ACL[k]] - (k == "sync_device")
        sim = sim_calls[k] + (creation[k] if r.allocator == "npu_pool" else 0)
        if live or sim:
            out.append((k, live, sim))
    return out


def audit(path: Path, python: str, env: dict[str, str], creation: dict[str, int]) -> tuple[list[str], int]:
    """The table rows of every trace in ``path``, and how many figures disagree."""
    rows, differ = [], 0
    for name, trace in open_traces(path):
        t0 = time.time()
        try:
            live = replay_live(trace, name, device="npu", python=python, env=env, min_capacity=True, timeout=3600)
        except LiveError as e:
            rows.append(f"| {name} | - | the live play failed: {e} | | | | |")
            differ += 1
            continue
        for r in live:
            policy = SIMULATED[r.allocator]
            sim = run(trace, policy, device="npu")
            cap = min_capacity(trace, policy, device="npu")[0]
            pairs = [(r.peak_reserved_bytes, sim.peak_reserved_bytes),
                     (r.peak_allocated_bytes, sim.stats["total"]["allocated"]["peak"]),
                     (r.min_capacity_bytes, cap), (r.device_allocs, sim.device_mallocs),
                     (r.device_frees, sim.stats["device_frees"])]
            kinds = _kind_counts(r, sim.calls, creation)
            differ += sum(a != b for a, b in pairs) + sum(a != b for _, a, b in kinds)
            cells = [f"{a}" if a == b else f"**{a} / {b}**" for a, b in pairs]
            calls = ", ".join(f"{k} {a}" if a == b else f"**{k} {a} / {b}**" for k, a, b in kinds)
            rows.append(f"| {name} | {r.allocator} | " + " | ".join(cells) + f" | {calls} |")
        print(f"live_audit: {name}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return rows, differ


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="*", help="snapshot pickles or .npt traces, or folders of them (default: "
                   "../shared/traces and benchmarks/traces)")
    p.add_argument("--python", default=str(ROOT / ".venv-torch-npu" / "bin" / "python"),
                   help="a Python with torch-npu 2.13.0 (default: the one ./run test makes)")
    p.add_argument("--doc", default=str(ROOT / "docs" / "live.md"), help="where to write the table")
    args = p.parse_args()
    if not Path(args.python).exists():
        raise SystemExit(f"live_audit: no Python with torch_npu at {args.python} (./run test makes .venv-torch-npu)")
    traces = [Path(t) for t in args.traces] or [q for q in (ROOT.parent / "shared" / "traces",
                                                             ROOT / "benchmarks" / "traces") if q.exists()]
    t0 = time.time()
    rows, differ = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        env = cann.env(cann.build(Path(tmp) / "cann"), ROOT, Path(tmp) / "cache", FAKE_CAPACITY=str(FAKE_CAPACITY))
        creation = _creation_calls()
        for path in traces:
            for f in sorted(path.iterdir()) if path.is_dir() else [path]:
                if f.suffix in (".pickle", ".npt"):
                    r, d = audit(f, args.python, env, creation)
                    rows += r
                    differ += d
    doc = ["# The simulator held to the live torch_npu, trace by trace", "",
           f"Written by `python benchmarks/live_audit.py` ({time.strftime('%Y-%m-%d')}, {len(rows)} rows, "
           f"{time.time() - t0:.0f} s). Each trace played live inside the real torch_npu 2.13.0 over the fake CANN "
           "runtime (tests/fake_vendor), under torch_npu's own allocator (native) and under npu_pool, each "
           "with its minimum capacity searched live; beside each figure, where it differs, the simulator's "
           "(`live / simulated`, in bold). Calls: the fake runtime's count of each memory call, synchronisation, "
           "event call and stream query (by the core's kind names: malloc = aclrtMalloc, phys_create = "
           "aclrtMallocPhysical, map = aclrtMapMem, event_record = aclrtRecordEvent, ...; the "
           "simulated npu_pool's with the calls of its pool's creation, which the live one makes inside the play; "
           "the player's final synchronisation taken out of the live count). Bytes exact.", "",
           f"Figures that differ: {differ}.", "",
           "| trace | allocator | peak reserved | peak allocated | min capacity | device allocs | device frees | "
           "calls |", "|---|---|---:|---:|---:|---:|---:|---|", *rows, ""]
    Path(args.doc).write_text("\n".join(doc))
    print(f"wrote {args.doc}: {differ} figures differ", file=sys.stderr)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
