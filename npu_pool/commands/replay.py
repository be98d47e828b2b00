"""``npu-pool replay``: replay traces through policies and print what each one wastes."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from ..config import COMPACTING_POLICIES
from ..device_costs import estimate_us, load_costs, physical_calls
from ..replay import HINTS, PolicyResult, evaluate, iteration_bounds, policies_from, validate
from ..trace.files import distinct_name, expand, open_traces, repairs, repairs_said
from ..trace.format import DEVICE_TYPES, forced_device
from ..progress import progress
from ..units import name_width, printable
from . import UsageError, policy_list

GiB = float(1 << 30)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("traces", nargs="+", metavar="TRACE", help=".npt traces, snapshot pickles, or directories of them")
    p.add_argument("--policy", default=None,
                   help="comma-separated policies (default: torch,expandable,npu_pool; add planned to plan each "
                   "trace and replay its plan, or give --plan)")
    p.add_argument("--json", metavar="OUT", help="write the records as a JSON list")
    p.add_argument("--hints", choices=list(HINTS), default=None,
                   help="what npu_pool learns lifetimes from: phase markers (default: what a device running the "
                        "recorder sees), sites (markers and the trace's site ids), oracle (the profiler's "
                        "categories), none")
    p.add_argument("--no-min-capacity", action="store_true", help="skip the minimum-capacity search (faster)")
    p.add_argument("--plan", metavar="PLAN", help="plan file for --policy planned (default: plan each trace itself)")
    p.add_argument("--compact", action="store_true",
                   help="the npu_pool and planned policies with compaction (docs/api.md; the other policies as they "
                        "are); with --live, npu_pool's process")
    p.add_argument("--costs", metavar="FILE",
                   help="JSON {call kind: microseconds} over the default per-call costs of the device-time estimate")
    p.add_argument("--validate", action="store_true",
                   help="check the torch model against the recorded run instead (snapshots only); with --live, "
                        "set each live figure beside the simulation's")
    add_device_argument(p)
    p.add_argument("--live", action="store_true",
                   help="replay on this machine's real device (torch_npu's npu, else CUDA) as tensors in trace "
                        "order, under the framework's allocator and under npu_pool, each in its own process")


def add_device_argument(p: argparse.ArgumentParser) -> None:
    """``--device npu|cuda``: whose request rules the simulated replays apply."""
    p.add_argument("--device", choices=DEVICE_TYPES, default=None,
                   help="the runtime whose rules the simulation applies: npu (torch_npu pads every request to "
                        "round_up(r, 32) + 32 bytes) or cuda (none); default: the trace's own device type "
                        "(cuda when the trace does not say)")


def format_table(results: list[PolicyResult]) -> str:
    """A fixed-width table of replay figures (GiB; 100 columns where no name is longer than 25
    characters, never cut); :data:`LEGEND` says what each column is."""
    w = name_width(r.trace for r in results)
    head = (f"{'trace':{w}} {'policy':10} {'peak live':>9} {'peak rsvd':>9} {'util':>7} {'min cap':>9} "
            f"{'over live':>9} {'retries':>7} {'mallocs':>7}")
    lines = [head, "-" * len(head)]
    for r in results:
        cap = "-" if r.min_capacity_bytes is None else f"{r.min_capacity_bytes / GiB:.3f}"
        over = "-" if r.min_capacity_bytes is None else f"{(r.min_capacity_bytes - r.peak_live_bytes) / GiB:.3f}"
        retries = "-" if r.retries_at_min_capacity is None else str(r.retries_at_min_capacity)
        lines.append(f"{r.trace:{w}} {r.policy:10} {r.peak_live_bytes / GiB:9.3f} {r.peak_reserved_bytes / GiB:9.3f} "
                     f"{r.utilization:7.2%} {cap:>9} {over:>9} {retries:>7} {r.device_mallocs:7d}")
    return "\n".join(lines)


LEGEND = """\
All sizes in GiB, each trace replayed on the simulated device:
  peak live  the most bytes of tensors alive at once: no allocator can need less (the lower bound)
  peak rsvd  the most memory the policy held from the device at once, given room to spare
  util       peak live / peak rsvd (100% = no memory wasted)
  min cap    the smallest device (in 2 MiB steps) on which the whole trace completes, found by
             bisection: 2 MiB less fails (allocators are not monotonic: a still smaller one may pass)
  over live  min cap - peak live: what the policy needs beyond the tensors themselves
  retries    at min cap, how often a request failed, the policy gave its free cache back to the
             device (a device-wide synchronisation) and retried: each one stalls training
  mallocs    device allocations made (cudaMalloc / aclrtMalloc, or chunk maps), given room to spare
Timings are left out: `python benchmarks/micro.py` measures them, side by side and repeated."""

CALLS_LEGEND = """\
Device calls, given room to spare (and at min cap), each a stall on a real card:
  physical   physical memory taken and given back: malloc + free (segments), phys_create + phys_release (chunks)
  map/unmap  mappings made and removed (virtual-memory policies)
  syncs      device and stream synchronisations
  other      events, stream queries, device look-ups, reservations
  steady     calls of every kind in the steady iterations: after the first, each one that needs no more
             live memory than an earlier stretch did, set-up included (where the trace repeats: its
             iteration markers, else its optimizer steps, else the period the planner finds; the
             last up to the trace's last iteration-end marker, teardown after it left out; - when
             none repeats or none is steady)
  est ms     the calls' estimated device time from the per-call cost table (docs/device_calls.md; --costs)"""


def _call_groups(c: dict[str, int]) -> tuple[int, int, int, int]:
    physical = physical_calls(c)
    maps = c["map"] + c["unmap"]
    syncs = c["sync_device"] + c["sync_stream"]
    return physical, maps, syncs, sum(c.values()) - physical - maps - syncs


def format_calls(results: list[PolicyResult], costs: dict) -> str:
    """Device calls by group for each result, with the estimated device time (ms)."""
    w = name_width(r.trace for r in results)
    head = (f"{'trace':{w}} {'policy':10} {'physical':>9} {'map/unmap':>9} {'syncs':>6} {'other':>6} {'steady':>6}"
            f" {'est ms':>8} {'@min cap: phys':>14} {'map/unmap':>9} {'est ms':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        if r.calls is None:
            continue
        p, m, sy, o = _call_groups(r.calls)
        steady = "-" if r.steady_calls is None else str(r.steady_calls)
        line = (f"{r.trace:{w}} {r.policy:10} {p:9d} {m:9d} {sy:6d} {o:6d} {steady:>6}"
                f" {estimate_us(r.calls, costs) / 1e3:8.1f}")
        if r.calls_at_min_capacity is not None:
            cp, cm, _, _ = _call_groups(r.calls_at_min_capacity)
            line += f" {cp:14d} {cm:9d} {estimate_us(r.calls_at_min_capacity, costs) / 1e3:8.1f}"
        lines.append(line)
    return "\n".join(lines)

VALIDATE_LEGEND = """\
  rec peak / sim peak  peak reserved of the recorded run / of the torch model replaying it (GiB)
  rec segs / sim segs  segment allocations (cudaMalloc calls) made while the recording ran, in the
                       recording and in the replay; segments that existed when the recording began
                       are not counted (`npu-pool export` lists every segment held at the end)
  same place           of the allocations both made, the share the model put at the recorded address"""


def _validate(named: list, out: str | None = None) -> int:
    failed = checked = 0
    records = []
    w = name_width((name for name, _ in named), 34)
    print(f"{'trace':{w}} {'rec peak':>10} {'sim peak':>10} {'rec segs':>8} {'sim segs':>8} {'same place':>10}  verdict")
    for name, trace in named:
        try:
            v = validate(trace, name)
        except ValueError as e:
            print(f"{name:{w}} skipped: {e}")
            continue
        failed += not v.passed
        checked += 1
        records.append({**asdict(v), "passed": v.passed})
        print(f"{name:{w}} {v.recorded_peak_reserved / GiB:10.3f} {v.simulated_peak_reserved / GiB:10.3f} "
              f"{v.recorded_segment_allocs:8d} {v.simulated_segment_allocs:8d} {v.same_place:10.1%}  "
              f"{'ok' if v.passed else 'MISMATCH'}")
    print(VALIDATE_LEGEND)
    if out:
        from ..outputs import output

        with output(out, "w") as f:  # whole or absent
            json.dump(records, f, indent=1)
        print(f"wrote {len(records)} records to {out}", file=sys.stderr)
    if not checked:  # nothing was compared: not a pass
        print("npu-pool replay: error: --validate compared nothing: every trace was skipped (above)", file=sys.stderr)
        return 1
    return 1 if failed else 0


DEFAULT_POLICIES = "torch,expandable,npu_pool"


def run(args: argparse.Namespace) -> int:
    if args.live or args.validate:  # they replay no policy of ours: an option for one would go unused
        given = [f"--{k}" for k in ("policy", "hints", "costs", "plan") if getattr(args, k) is not None]
        given += ["--compact"] if args.compact and not args.live else []  # (--live: npu_pool's worker compacts)
        if args.validate and not args.live and args.device is not None:  # (the recording's own rules are compared)
            given.append("--device")
        if given:
            mode, what = (("--live", "the framework allocator and npu_pool on the real device") if args.live
                          else ("--validate", "the torch model against the recording"))
            raise UsageError(f"{mode} takes no {', '.join(given)}: it replays {what}")
    args.policy = DEFAULT_POLICIES if args.policy is None else args.policy
    policies = policy_list(args.policy)  # before any trace is opened ("" is no policy)
    args.hints = args.hints or "markers"
    if args.plan and "planned" not in policies:
        raise UsageError("--plan is the plan policy planned replays: add planned to --policy "
                         "(e.g. --policy npu_pool,planned)")
    if args.compact and not set(COMPACTING_POLICIES) & set(policies):
        raise UsageError("--compact applies to the npu_pool and planned policies: add one to --policy")
    seen: dict = {}
    named = [(distinct_name(n, path, seen), t) for path in expand(args.traces) for n, t in open_traces(path)]
    for name, t in named:
        fixed = repairs(t)
        if fixed:
            print(f"note: {printable(name)}: {printable(repairs_said(fixed))}", file=sys.stderr)
    if args.json:  # now, not after every replay (the traces are read: one of them is refused as --json too)
        from ..outputs import check

        check(args.json)
    if args.live:
        return _live(named, args)
    with forced_device(args.device):
        return _simulate(named, args)


def _simulate(named: list, args: argparse.Namespace) -> int:
    if args.validate:
        return _validate(named, args.json)
    policies = policies_from(args.policy)
    costs = load_costs(args.costs)
    results, online = [], []
    given = None
    if args.plan and "planned" in policies:
        from ..planner.runtime import as_plan

        given = as_plan(args.plan)  # read once, for every trace
    # a step per trace and policy, not per trace (one large trace sat at 0/1 for the whole run)
    bar = iter(progress(range(len(named) * len(policies)), desc="replay", unit="replay"))
    next(bar, None)  # (shown at 0 now; each next() after a replay counts it)
    for name, trace in named:
        bounds = iteration_bounds(trace)  # (once: the steady column's, for every policy)
        for policy in policies:
            plan = None
            if policy == "planned":
                from ..planner import make_plan
                from ..planner.iteration import NothingToPlan

                try:
                    plan = given or make_plan(trace, name)
                except NothingToPlan as e:  # (a window of frees only): the row of the online pool
                    online.append(f"planned on {name}: runs online (no plan: {printable(str(e))})")
                else:
                    if plan.meta.get("online"):  # (a plan given with --plan too: its row is the online pool's)
                        online.append(f"planned on {name}: runs online (the plan "
                                      f"{printable(str(plan.meta['online']))})")
            results.append(evaluate(trace, name, policy, hints=args.hints,
                                    with_min_capacity=not args.no_min_capacity, plan=plan, bounds=bounds,
                                    compact=args.compact and policy in COMPACTING_POLICIES))
            next(bar, None)
    next(bar, None)  # (let the bar see its end, and close)
    print(format_table(results))
    print(LEGEND)
    print()
    print(format_calls(results, costs))
    print(CALLS_LEGEND)
    for line in online:
        print(line)
    if args.json:
        from ..outputs import output

        with output(args.json, "w") as f:  # whole or absent
            json.dump([r.as_dict() for r in results], f, indent=1)
        print(f"wrote {len(results)} records to {args.json}", file=sys.stderr)
    return 0


def _live(named: list, args: argparse.Namespace) -> int:
    """``--live [--validate]``: the trace on the real device, each allocator in its own process."""
    from ..live import LEGEND as LIVE_LEGEND, LiveError, format_live, replay_live, simulated

    rows = []
    for name, trace in named:
        try:
            live = replay_live(trace, name, device=args.device, min_capacity=not args.no_min_capacity,
                               compact=args.compact)
        except LiveError as e:
            print(f"npu-pool replay --live: error: {e}", file=sys.stderr)
            return 1
        rows += [(r, simulated(trace, r, not args.no_min_capacity) if args.validate else None) for r in live]
    print(format_live(rows))
    print(LIVE_LEGEND)
    if args.json:
        from ..outputs import output

        with output(args.json, "w") as f:  # whole or absent
            json.dump([dict(r.as_dict(), **({"simulated": sim} if sim else {})) for r, sim in rows], f, indent=1)
        print(f"wrote {len(rows)} records to {args.json}", file=sys.stderr)
    return 1 if any(sim and not sim["same"] for _, sim in rows) else 0
