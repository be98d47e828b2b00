"""``npu-pool replay``: replay traces through policies and print what each one wastes."""
from __future__ import annotations

import argparse
import json
import sys

from ..replay import HINTS, PolicyResult, evaluate, policies_from, validate
from ..trace.files import expand, open_traces
from ..progress import progress

GiB = float(1 << 30)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("traces", nargs="+", metavar="TRACE", help=".npt traces, snapshot pickles, or directories of them")
    p.add_argument("--policy", default="torch,expandable,npu_pool", help="comma-separated policies (default: all)")
    p.add_argument("--json", metavar="OUT", help="write the records as a JSON list")
    p.add_argument("--hints", choices=list(HINTS), default="markers",
                   help="what npu_pool learns lifetimes from: phase markers (default: what a device running the "
                        "recorder sees), sites (markers and the trace's site ids), oracle (the profiler's "
                        "categories), none")
    p.add_argument("--no-min-capacity", action="store_true", help="skip the minimum-capacity search (faster)")
    p.add_argument("--plan", metavar="PLAN", help="plan file for --policy planned (default: plan each trace itself)")
    p.add_argument("--validate", action="store_true",
                   help="check the torch model against the recorded run instead (snapshots only)")


def format_table(results: list[PolicyResult]) -> str:
    """A fixed-width table of replay figures."""
    head = (f"{'trace':34} {'policy':11} {'peak live':>10} {'peak rsvd':>10} {'util':>7} {'min cap':>10} "
            f"{'over live':>10} {'retries':>7} {'mallocs':>8} {'ns/op':>7}")
    lines = [head, "-" * len(head)]
    for r in results:
        cap = "-" if r.min_capacity_bytes is None else f"{r.min_capacity_bytes / GiB:.3f}"
        over = "-" if r.min_capacity_bytes is None else f"{(r.min_capacity_bytes - r.peak_live_bytes) / GiB:.3f}"
        retries = "-" if r.retries_at_min_capacity is None else str(r.retries_at_min_capacity)
        lines.append(f"{r.trace[:34]:34} {r.policy:11} {r.peak_live_bytes / GiB:10.3f} {r.peak_reserved_bytes / GiB:10.3f} "
                     f"{r.utilization:7.2%} {cap:>10} {over:>10} {retries:>7} {r.device_mallocs:8d} {r.ns_per_op:7.0f}")
    lines.append("(GiB; min cap = smallest simulated device on which the trace completes, 2 MiB resolution)")
    return "\n".join(lines)


def _validate(named: list) -> int:
    failed = 0
    print(f"{'trace':34} {'rec peak':>10} {'sim peak':>10} {'rec segs':>8} {'sim segs':>8} {'same place':>10}  verdict")
    for name, trace in named:
        try:
            v = validate(trace, name)
        except ValueError as e:
            print(f"{name[:34]:34} skipped: {e}")
            continue
        failed += not v.passed
        print(f"{name[:34]:34} {v.recorded_peak_reserved / GiB:10.3f} {v.simulated_peak_reserved / GiB:10.3f} "
              f"{v.recorded_segment_allocs:8d} {v.simulated_segment_allocs:8d} {v.same_place:10.1%}  "
              f"{'ok' if v.passed else 'MISMATCH'}")
    return 1 if failed else 0


def run(args: argparse.Namespace) -> int:
    named = [nt for path in expand(args.traces) for nt in open_traces(path)]
    if args.validate:
        return _validate(named)
    policies = policies_from(args.policy)
    results, online = [], []
    for name, trace in progress([(n, t) for n, t in named], desc="replay", unit="trace"):
        for policy in policies:
            plan = None
            if policy == "planned":
                from ..planner import make_plan

                plan = args.plan or make_plan(trace, name)
                if not args.plan and plan.meta.get("online"):
                    online.append(f"planned on {name}: runs online (the plan {plan.meta['online']})")
            results.append(evaluate(trace, name, policy, hints=args.hints,
                                    with_min_capacity=not args.no_min_capacity, plan=plan))
    print(format_table(results))
    for line in online:
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.as_dict() for r in results], f, indent=1)
        print(f"wrote {len(results)} records to {args.json}", file=sys.stderr)
    return 0
