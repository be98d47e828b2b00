"""The experiment's steps on a full device in the simulator (README.md): run from the root of a
checkout of 5b3950e with experiment.patch applied and built, e.g.

    NP_EXP=1665 NP_EXP_BUSY=50 python benchmarks/results/h200-2026-11-26/busy.py

Prints, per trace and cap, the device calls of each iteration (the recording's optimizer steps),
the device synchronisations and the retries. The bounds are computed here as this project's
replay.iteration_bounds does since 2026-11-26 (5b3950e's cut inside steps)."""
import os
import sys
from pathlib import Path

sys.path[:0] = [os.getcwd()]
from npu_pool import vocab  # noqa: E402
from npu_pool.planner.iteration import find_window  # noqa: E402
from npu_pool.replay import run  # noqa: E402
from npu_pool.trace.files import open_traces  # noqa: E402


def iteration_bounds(t):
    first = next(i for i, op in enumerate(t.op) if op == vocab.OP_ALLOC)
    ends = [i + 1 for i, (op, cat) in enumerate(zip(t.op, t.cat))
            if op == vocab.OP_MARK and cat == vocab.MARK_OPTIMIZER_END and first < i + 1 < len(t)]
    if len(ends) >= 2:
        return [first] + ends
    w = find_window(t)
    return ([w.start] if w.start < w.body else []) + list(range(w.body, len(t), w.end - w.body))


for p in ["benchmarks/traces/h100-gpt-bf16-train.pickle", "../shared/traces/cs336-medium-ctx1024-infer.pickle"]:
    (_, t), *_ = open_traces(Path(p))
    b = iteration_bounds(t)
    for mib in ([2162, 2194, 2226] if "h100" in p else [2994, 3050]):
        r = run(t, "npu_pool", mib << 20, device="cuda", bounds=b)
        it = [sum(d.values()) for d in r.iteration_calls] if r.ok else None
        print(Path(p).stem, mib, r.ok, it, "sync", r.calls.get("sync_device"), "retries", r.retries)
