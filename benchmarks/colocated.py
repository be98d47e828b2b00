"""Colocated RL: npu_pool's pause/resume against explicit offload; writes the figures of docs/colocated.md.

    python benchmarks/colocated.py [--cycles 12] [--trace FILE] [--doc docs/colocated.md]

The trace is :func:`npu_pool.capture.colocated.colocated_capture` (a 7B Llama training step on
fake tensors, one rank of tp 8, and a modelled vLLM-style rollout; saved to ``--trace`` and reused
when that file exists). It is replayed through

- ``npu_pool``: the tags are paused and resumed (addresses kept, physical memory returned);
- ``torch`` (PyTorch's caching allocator) and ``expandable`` (its expandable segments) with
  explicit offload: a pause frees the tag's tensors and empties the cache, a resume allocates
  them again -- what verl / MindSpeed-RL do without a pausing allocator.

Per policy: peak reserved bytes in every cycle (room to spare), and the minimum capacity (smallest
simulated device, 2 MiB resolution, on which the first k cycles complete) for growing k: a figure
that grows with k is memory lost to fragmentation cycle after cycle. Every figure comes from this
script; rerun it to refresh the file.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from npu_pool.capture.colocated import colocated_capture, cycle_bounds, resident  # noqa: E402
from npu_pool.replay import CAPACITY_STEP, min_capacity  # noqa: E402
from npu_pool.timeline import timeline  # noqa: E402
from npu_pool.trace.format import OP_ALLOC, Trace  # noqa: E402
from npu_pool.trace.stats import live_profile  # noqa: E402

POLICIES = ["npu_pool", "torch", "expandable"]
BEGIN, END = "<!-- figures begin -->", "<!-- figures end -->"
GiB = float(1 << 30)


def prefix(trace: Trace, end: int) -> Trace:
    """The first `end` events (ids are numbered in order of allocation, so they stay dense)."""
    t = Trace(meta=dict(trace.meta))
    for col in ("op", "cat", "site", "id", "size", "stream", "addr"):
        getattr(t, col).extend(getattr(trace, col)[:end])
    t.meta["n_ids"] = sum(1 for op in t.op if op == OP_ALLOC)
    return t


def measure(trace: Trace, ks: list[int]) -> dict:
    bounds = cycle_bounds(trace)
    out: dict = {"events": len(trace), "cycles": len(bounds), "policies": {},
                 "peak_live": live_profile(trace).peak_bytes}
    # what pausing saves: the same program keeping everything resident (pause/resume removed)
    kept = resident(trace)
    runs = [(pol, pol, trace) for pol in POLICIES] + [("torch, nothing offloaded", "torch", kept)]
    for name, pol, t in runs:
        t0 = time.perf_counter()
        tl = timeline(t, pol)
        b = bounds if t is trace else _shift(trace, bounds)
        per_cycle = [max(tl.reserved[s:e]) for s, e in b]
        mins = {}
        for k in ks:
            cap, _ = min_capacity(prefix(t, b[k - 1][1]), pol, lo=CAPACITY_STEP)
            mins[k] = cap
        out["policies"][name] = {"ok": tl.ok, "peak_reserved": tl.peak_reserved, "peak_per_cycle": per_cycle,
                                "min_capacity": mins, "device_mallocs": tl.stats["device_mallocs"],
                                "device_frees": tl.stats["device_frees"], "s": round(time.perf_counter() - t0, 1)}
    return out


def _shift(trace: Trace, bounds: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The cycle bounds of `trace` in its resident copy (pause and resume events removed)."""
    from npu_pool.trace.format import OP_PAUSE, OP_RESUME

    removed, k, out = 0, 0, []
    marks = []
    for i, op in enumerate(trace.op):
        marks.append(removed)
        if op in (OP_PAUSE, OP_RESUME):
            removed += 1
    marks.append(removed)
    for s, e in bounds:
        out.append((s - marks[s], e - marks[e]))
    return out


def markdown(res: dict, cmd: str) -> str:
    pols = res["policies"]
    ks = list(next(iter(pols.values()))["min_capacity"])
    lines = [f"<!-- written by `{cmd}` -->", "",
             f"Trace: {res['events']} events, {res['cycles']} cycles "
             "(7B Llama, one rank of tp 8, bf16; rollout batch 64, prompt 512, response 1024); "
             f"peak live on the device (a paused tag's tensors are not): {res['peak_live'] / GiB:.3f} GiB, "
             "the lower bound.", "",
             "Minimum capacity (GiB) for the first k cycles:", "",
             "| policy | " + " | ".join(f"k={k}" for k in ks) + " | growth k=1 -> k=" + str(ks[-1]) + " |",
             "|---|" + "---|" * (len(ks) + 1)]
    for pol, r in pols.items():
        m = [r["min_capacity"][k] for k in ks]
        lines.append(f"| {pol} | " + " | ".join(f"{x / GiB:.3f}" for x in m) + f" | {(m[-1] - m[0]) / GiB:+.3f} |")
    lines += ["", "Peak reserved (GiB) in each cycle, room to spare:", "",
              "| policy | " + " | ".join(f"c{i + 1}" for i in range(res["cycles"])) + " |",
              "|---|" + "---|" * res["cycles"]]
    for pol, r in pols.items():
        lines.append(f"| {pol} | " + " | ".join(f"{x / GiB:.2f}" for x in r["peak_per_cycle"]) + " |")
    lines += ["", "Device calls over the whole run (room to spare):", "", "| policy | mallocs/maps | frees/unmaps |",
              "|---|---|---|"]
    for pol, r in pols.items():
        lines.append(f"| {pol} | {r['device_mallocs']} | {r['device_frees']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=12)
    ap.add_argument("--trace", default="/tmp/npu_pool_colocated_7b.nptrace", help="trace file (made if absent)")
    ap.add_argument("--doc", help="replace the figures between the markers of this Markdown file (docs/colocated.md)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    a = ap.parse_args()
    path = Path(a.trace)
    trace = Trace.load(path) if path.exists() else None
    if trace is None or len(cycle_bounds(trace)) != a.cycles:
        trace = colocated_capture(cycles=a.cycles)
        trace.save(path)
    ks = sorted({1, 2, 4, a.cycles // 2, a.cycles} - {0})
    res = measure(trace, ks)
    if a.json:
        print(json.dumps(res, indent=1))
        return
    text = markdown(res, "python benchmarks/colocated.py" + (f" --cycles {a.cycles}" if a.cycles != 12 else ""))
    if a.doc:
        doc = Path(a.doc).read_text()
        head, rest = doc.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        Path(a.doc).write_text(head + BEGIN + "\n" + text + END + tail)
    print(text)


if __name__ == "__main__":
    main()
