"""``npu-pool analyze TRACE``: where the memory goes (peak, breakdown, sites, layers, fragmentation)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..replay import HINTS
from ..trace.format import forced_device
from . import policy_list, whole
from .replay import add_device_argument


def _html_name(first: str) -> Path:
    """<first trace>.html in the current folder; a folder given as "." or ".." is named by what it
    resolves to (its stem would be empty: a hidden ".html")."""
    p = Path(first.rstrip("/") or "/")
    stem = p.stem if p.name not in ("", ".", "..") else p.resolve().name
    return Path((stem or "root") + ".html")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("traces", nargs="+", metavar="TRACE",
                   help=".npt trace, snapshot pickle, or a directory of per-rank traces (one table across ranks)")
    p.add_argument("--format", choices=("md", "json", "html"), default="md", help="report format (default md)")
    p.add_argument("--out", "-o", metavar="PATH", help="write the report here (default: stdout; html: "
                   "<first trace>.html)")
    p.add_argument("--policy", default="torch,expandable,npu_pool", help="comma-separated policies to replay, of torch, expandable, npu_pool (default: all three)")
    p.add_argument("--hints", choices=[h for h in HINTS if h != "oracle"], default="markers",
                   help="what npu_pool learns lifetimes from during the replay: the phase markers (markers, the "
                   "default), markers and the trace's site ids (sites), or nothing (none)")
    p.add_argument("--min-capacity", action="store_true", help="also search each policy's minimum device size (slower)")
    p.add_argument("--top", type=whole(0), default=15, help="allocation sites listed in md/json (default 15)")
    p.add_argument("--estimate", action="store_true",
                   help="add the static estimate vs the trace (config from --config, or the capture's own)")
    p.add_argument("--config", metavar="YAML", help="model config for --estimate (implies it)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_device_argument(p)


def _captures_known(named: list) -> None:
    """--estimate without --config: a trace of a known model's capture is needed; said before the
    replays (after them, 36 s on a large trace: a review of the commands at scale)."""
    from ..analysis.estimate import config_from_trace

    if not any(config_from_trace({"capture": t.meta.get("capture")}) for _, t in named):
        raise ValueError(f"{named[0][0]}: not a capture of a known model; give --config YAML for --estimate")


def _estimate_rows(args: argparse.Namespace, analysis) -> list | None:
    from ..analysis.estimate import compare, config_from_trace, estimate, load_config

    if not (args.estimate or args.config):
        return None
    worst = analysis.worst()
    if args.config:
        cfg = load_config(args.config)
    else:
        cfg = config_from_trace({"capture": worst.capture})
        if cfg is None:
            raise ValueError(f"{worst.name}: not a capture of a known model; give --config YAML for --estimate")
    return compare(estimate(cfg), worst.profile)


def run(args: argparse.Namespace) -> int:
    from ..analysis.report import analyze_paths, to_json, to_markdown

    policies = policy_list(args.policy, planned=False)
    show = None if not args.no_progress else False
    out = Path(args.out) if args.out else _html_name(args.traces[0]) if args.format == "html" else None
    if out is not None:  # now, not after the replays
        from ..outputs import check

        check(out)
    with forced_device(args.device):
        analysis = analyze_paths(args.traces, policies, min_capacity=args.min_capacity, curves=args.format == "html",
                                 hints=args.hints, show_progress=show,
                                 loaded=_captures_known if args.estimate and not args.config else None)
    rows = _estimate_rows(args, analysis)
    if args.format == "html":
        from ..analysis.html import render_html

        text = render_html(analysis, estimate_rows=rows)
    elif args.format == "json":
        d = to_json(analysis, args.top)
        if rows is not None:
            d["estimate_vs_trace"] = [r.as_dict() for r in rows]
        text = json.dumps(d, indent=1) + "\n"
    else:
        text = to_markdown(analysis, args.top)
        if rows is not None:
            from ..units import fmt_bytes

            text += ("\n## Static estimate vs the trace\n\n| figure | estimated | measured | diff | ratio |\n"
                     "|---|---:|---:|---:|---:|\n")
            for r in rows:
                text += (f"| {r.figure} | {'-' if r.estimated is None else fmt_bytes(r.estimated)} | "
                         f"{'-' if r.measured is None else fmt_bytes(r.measured)} | "
                         f"{'-' if r.diff is None else fmt_bytes(r.diff)} | "
                         f"{'-' if r.ratio is None else f'{r.ratio:.3f}'} |\n")
    if out is None:
        sys.stdout.write(text)
    else:
        from ..outputs import write_text

        write_text(out, text)  # whole or absent
        print(f"wrote {out}", file=sys.stderr)
    return 0
