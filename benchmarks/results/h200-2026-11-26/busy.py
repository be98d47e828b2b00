"""The experiment's steps on a full device in the simulator (README.md): run from the root of a
checkout of 5b3950e with experiment.patch applied and built, e.g.

    NP_EXP=1665 NP_EXP_BUSY=50 python benchmarks/results/h200-2026-11-26/busy.py

Prints, per trace and cap, the device calls of each optimizer step (each iteration), the device
synchronisations and the retries. (The iteration bounds are those of commit 935836b.)"""
import os
import sys
from pathlib import Path

sys.path[:0] = [os.getcwd()]
from npu_pool.replay import iteration_bounds, run  # noqa: E402
from npu_pool.trace.files import open_traces  # noqa: E402

for p in ["benchmarks/traces/h100-gpt-bf16-train.pickle", "../shared/traces/cs336-medium-ctx1024-infer.pickle"]:
    (_, t), *_ = open_traces(Path(p))
    b = iteration_bounds(t)
    for mib in ([2162, 2194, 2226] if "h100" in p else [2994, 3050]):
        r = run(t, "npu_pool", mib << 20, device="cuda", bounds=b)
        it = [sum(d.values()) for d in r.iteration_calls] if r.ok else None
        print(Path(p).stem, mib, r.ok, it, "sync", r.calls.get("sync_device"), "retries", r.retries)
