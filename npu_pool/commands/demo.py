"""``npu-pool demo``: the main job on the built-in default.

Captures real training steps of small models on the CPU, then replays those
traces (and ../shared/traces when present) through every policy on the
simulated device and prints what each policy reserves and needs.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ..progress import progress
from ..replay import evaluate, policies_from
from .replay import format_table

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "traces"
# (name, capture arguments): a dense GPT, a Llama-style model with recompute, an MoE.
WORKLOADS = [
    ("cpu-gpt-train", dict(model_name="gpt", steps=3)),
    ("cpu-llama-recompute", dict(model_name="llama", steps=3, recompute=True)),
    ("cpu-moe-accum2", dict(model_name="moe", steps=3, grad_accum=2)),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", default="torch,expandable,npu_pool", help="comma-separated policies")
    p.add_argument("--shared", default=str(SHARED), help="folder of real snapshots to replay too (skipped if absent)")
    p.add_argument("--no-capture", action="store_true", help="replay the shared traces only")


def run(args: argparse.Namespace) -> int:
    policies = policies_from(args.policy)
    named = []
    if not args.no_capture:
        from ..capture import capture

        for name, kwargs in progress(WORKLOADS, desc="capture", unit="model"):
            print(f"capturing {name} on the CPU ...", flush=True)
            named.append((name, capture(progress=False, **kwargs)))
    shared = Path(args.shared)
    if shared.is_dir():
        from ..trace.files import open_traces

        for path in sorted(shared.glob("*.pickle")):
            named.extend(open_traces(path))
    else:
        print(f"({shared} not found: replaying the captured traces only)")
    results = [evaluate(trace, name, policy)
               for name, trace in progress(named, desc="replay", unit="trace") for policy in policies]
    print(format_table(results))
    for policy in policies:
        rs = [r for r in results if r.policy == policy]
        waste = sum(r.min_capacity_bytes - r.peak_live_bytes for r in rs) / (1 << 30)
        print(f"{policy:11} total minimum capacity over live: {waste:.3f} GiB over {len(rs)} traces")
    return 0
