"""``npu-pool export TRACE --out FILE.pickle``: a PyTorch memory snapshot that memory_viz opens."""
from __future__ import annotations

import argparse
import sys

from ..analysis.memviz import POLICIES
from ..trace.format import forced_device
from . import UsageError
from .replay import add_device_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", metavar="TRACE", help=".npt trace or snapshot pickle (every device in it is exported)")
    p.add_argument("--policy", default="npu_pool", choices=(*POLICIES[:-1], "planned", POLICIES[-1]),
                   metavar="{" + ",".join(POLICIES) + "}",  # (planned: accepted to be refused with why, not offered)
                   help="replay under this policy for addresses and segments (default npu_pool); 'recorded' keeps "
                        "the trace's own addresses (imported snapshots)")
    p.add_argument("--hints", choices=("markers", "sites", "none"), default="markers",
                   help="what npu_pool learns lifetimes from during the replay (default: markers; as analyze)")
    p.add_argument("--out", "-o", required=True, metavar="FILE.pickle", help="snapshot to write")
    add_device_argument(p)


def run(args: argparse.Namespace) -> int:
    from ..analysis.memviz import export
    from ..trace.files import open_traces

    if args.out.endswith(".npt"):  # (replay, analyze and plan would read it as an npu_pool trace and refuse it)
        raise UsageError(f"--out {args.out}: export writes a PyTorch snapshot; name it .pickle "
                         "(`npu-pool import` makes .npt traces)")
    if args.policy == "planned":  # (before the trace is read)
        from ..replay import NEEDS_PLAN

        raise UsageError(NEEDS_PLAN)
    named = open_traces(args.trace)
    with forced_device(args.device):
        done = export([t for _, t in named], args.policy, args.out, hints=args.hints)  # streamed, whole or absent
    path = done.path
    print(f"wrote {path}: {len(named)} device trace(s), {done.entries} events, {done.segments} segments "
          f"({done.reserved / 2**30:.3f} GiB reserved at the end) under {args.policy}", file=sys.stderr)
    for dev, event in done.failed.items():
        print(f"warning: device {dev}: the replay under {args.policy} stopped at trace event {event}, a request the "
              "simulated 1 TiB device could not serve: the snapshot ends there, with that out-of-memory", file=sys.stderr)
    print(f"view: python -m torch.cuda._memory_viz trace_plot {path} -o {path}.html  (or drop it on "
          "https://pytorch.org/memory_viz)", file=sys.stderr)
    return 0
