"""``npu-pool plan``: trace -> plan file (offline placement of a steady iteration)."""
from __future__ import annotations

import argparse
import json
import math
import sys

from ..trace.format import device_type, forced_device
from ..units import printable
from . import UsageError

GiB = float(1 << 30)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", metavar="TRACE", nargs="?", help="an .npt trace or a PyTorch snapshot pickle")
    p.add_argument("--out", "-o", metavar="PLAN", help="write the plan here (.npplan)")
    p.add_argument("--device", type=_device, metavar="npu|cuda|N|npu:N",
                   help="npu or cuda: whose request rules the planner's replays apply (default: the trace's own "
                        "device type); N: which device of a multi-device snapshot; npu:N both")
    p.add_argument("--json", action="store_true", help="print the plan's figures as JSON")
    p.add_argument("--check", metavar="PLAN", help="verify an existing plan file instead and print its figures "
                   "(with TRACE: also that the plan was made for that trace's iteration)")


def _device(text: str) -> tuple[str | None, int | None]:
    """``--device``: "npu", "cuda", "N" or "npu:N" -> (device type or None, index or None)."""
    kind, sep, index = text.partition(":")
    digits = lambda s: s.isascii() and s.isdigit()  # noqa: E731  (str.isdigit alone takes "²", which int() refuses)
    if not sep and digits(kind):
        kind, index = "", kind
    if kind not in ("", "npu", "cuda") or not (digits(index) if sep or not kind else True):
        raise argparse.ArgumentTypeError(f"{text!r}: expected npu, cuda, a device index N, or npu:N / cuda:N")
    return kind or None, int(index) if index else None


def _pick(path: str, device: int | None):
    from ..trace.files import open_traces

    named = open_traces(path)
    if device is not None:
        named = [(n, t) for n, t in named if t.meta.get("device", 0) == device]
        if not named:
            raise ValueError(f"{path}: no trace of device {device}")
    if len(named) > 1:
        devs = ", ".join(str(t.meta.get("device", i)) for i, (_, t) in enumerate(named))
        raise ValueError(f"{path} holds {len(named)} devices ({devs}): choose one with --device")
    return named[0]


def _summary(meta: dict) -> str:
    try:
        return _rows(meta)
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # a plan's meta is input like any other
        raise ValueError(f"the plan's meta is malformed ({type(e).__name__}: {str(e)[:80]}); "
                         "--json prints it as it is") from None


def _number(meta: dict, key: str) -> float | None:
    """A figure of the meta; None where it is missing (a plan with no meta installs as well); a
    ValueError naming it where it is not a finite number."""
    v = meta.get(key)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise ValueError(f"{key} is {str(v)[:40]!r}")
    return v


def _gib(meta: dict, key: str) -> str:
    v = _number(meta, key)
    return "-" if v is None else f"{v / GiB:.3f} GiB"


def _rows(meta: dict) -> str:
    ratio = _number(meta, "ratio")
    ratio = "-" if ratio is None else f"{ratio:.4f} x peak live"
    rows = [("trace", str(meta.get("source", ""))[:200]),
            ("iteration", f"{meta.get('method')} (seen {meta.get('repeats')}x), {meta.get('positions')} positions"
                          f" ({meta.get('prologue', 0)} prologue), {meta.get('unplanned')} unplanned"),
            ("peak live", _gib(meta, "peak_live_bytes") + (" (of the recorded step followed by the step made again, "
                                                            "as a run that goes on holds it)"
                                                            if meta.get("method") == "whole" else "")),
            ("region", f"{_gib(meta, 'region_bytes')} (order: {meta.get('order')})"),
            ("outside plan", f"{_gib(meta, 'outside_peak_bytes')} (held by the fallback)"),
            ("planned peak", f"{_gib(meta, 'planned_peak_bytes')} = {ratio}"),
            ("time", f"{meta.get('seconds', 0):.2f} s")]
    if "online_reserved_bytes" in meta:
        c = meta.get("replay_counts", {})
        rows.insert(-1, ("replayed", f"{_gib(meta, 'replay_reserved_bytes')} reserved with the plan, "
                                     f"{_gib(meta, 'online_reserved_bytes')} online (npu_pool); requests "
                                     f"served by the plan {c.get('served', 0)}, in idle ranges {c.get('idle', 0)}, "
                                     f"fallen back {c.get('fallback', 0)}"))
    if "onward_reserved_bytes" in meta and "onward_passes" in meta:
        rows.insert(-1, ("goes on", f"{_gib(meta, 'onward_reserved_bytes')} reserved with the plan, "
                                    f"{_gib(meta, 'onward_online_reserved_bytes')} online, with the recorded step "
                                    f"made {meta.get('onward_passes')} more times (a plan of a whole trace: "
                                    "docs/planner.md)"))
    if meta.get("onward_skipped"):
        rows.insert(-1, ("goes on", f"not checked past the recorded step ({meta['onward_skipped']})"))
    if meta.get("online"):
        advice = ("; the trace shows one step, so the planner cannot see how the steps after it differ: "
                  "record two or more (a memory snapshot over several iterations, or `npu-pool capture --steps 3`)"
                  if meta.get("method") == "whole" else "")
        rows.insert(-1, ("runs online", f"the plan is worse than the online pool ({meta['online']}): "
                                         "installing it installs nothing, the planned policy serves every "
                                         f"request as npu_pool does{advice}"))
    return "\n".join(f"{k:13} {printable(str(v))}" for k, v in rows)  # (a plan's meta is a file's: no escapes)


def run(args: argparse.Namespace) -> int:
    from ..planner import make_plan, save_plan
    from ..planner.make import STAGES
    from ..progress import progress

    if args.check:
        if args.out:
            raise UsageError("--check reads a plan and writes none: drop --out")
        from ..planner.runtime import as_plan, check_made_for

        plan = as_plan(args.check)  # verifies (and names the file in later messages)
        made_for = ""
        if args.trace:  # and it was made for this trace's iteration and request rules, as replay checks
            kind, index = args.device or (None, None)
            name, trace = _pick(args.trace, index)
            check_made_for(plan, trace, name, device_type(trace, kind))
            made_for = f" for {name}"
        figures = {**plan.meta, "region_bytes": plan.region}  # the region the policy maps: the header's
        print(json.dumps(plan.meta, indent=1) if args.json else f"{args.check}: ok{made_for}\n{_summary(figures)}")
        return 0
    if not args.trace:
        raise UsageError("give a TRACE to plan (or --check PLAN)")
    kind, index = args.device or (None, None)
    name, trace = _pick(args.trace, index)
    if args.out:  # now, not after the planning
        from ..outputs import check

        check(args.out)
    bar = progress(range(len(STAGES)), desc="plan", unit="stage", total=len(STAGES))  # (a terminal only)
    steps = iter(bar)

    def on_stage(stage: str) -> None:
        next(steps, None)
        if hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(stage)

    with forced_device(kind):
        plan = make_plan(trace, name, on_stage=on_stage)
    next(steps, None)  # (let the bar see its end, and close)
    if args.out:
        save_plan(plan, args.out)
    print(json.dumps(plan.meta, indent=1) if args.json else _summary(plan.meta))
    if args.out:
        print(f"wrote {plan.n} positions to {args.out}", file=sys.stderr)
    return 0
