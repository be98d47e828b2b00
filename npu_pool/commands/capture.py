"""``npu-pool capture``: record the allocation trace of real (or fake) training steps."""
from __future__ import annotations

import argparse
import sys

from .. import outputs
from ..capture.real import DEFAULTS
from ..units import fmt_bytes
from . import whole

_FAKE_SEQ = 2048


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..workloads import MODEL_NAMES, SHAPES

    p.add_argument("--model", default=DEFAULTS["model"], choices=MODEL_NAMES,
                   help="model to train")
    p.add_argument("--steps", type=whole(), default=DEFAULTS["steps"],
                   help="training iterations (a real capture's profiler holds every op in memory, ~27 MB a step "
                        "for the default model: one that would not fit stops after two steps, saying how many would)")
    p.add_argument("--batch", type=whole(), default=DEFAULTS["batch"], help="sequences per micro-batch")
    p.add_argument("--seq", type=whole(), default=None,
                   help=f"tokens per sequence (default {DEFAULTS['seq']}, {_FAKE_SEQ} with --fake)")
    p.add_argument("--layers", type=whole(), default=None, help="blocks (default: small model's, or shape's / pp)")
    p.add_argument("--dim", type=whole(), default=None, help=f"hidden size of the small model (default {DEFAULTS['dim']})")
    p.add_argument("--heads", type=whole(), default=None, help=f"attention heads (default {DEFAULTS['heads']})")
    p.add_argument("--vocab", type=whole(), default=None, help=f"vocabulary (default {DEFAULTS['vocab']})")
    p.add_argument("--recompute", action="store_true", help="activation checkpointing per block")
    p.add_argument("--grad-accum", type=whole(), default=1, metavar="K", help="micro-batches per step")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast forwards (mixed precision)")
    p.add_argument("--shape", choices=sorted(SHAPES), help="published layer shape (implies --fake)")
    p.add_argument("--fake", action="store_true", help="FakeTensorMode: shapes only, no memory used")
    p.add_argument("--tp", type=whole(), default=1, help="tensor-parallel degree to slice the shape by (fake)")
    p.add_argument("--pp", type=whole(), default=1, help="pipeline stages to divide the layers by (fake)")
    p.add_argument("--keep-host-scalars", action="store_true",
                   help="keep 0-dim host scalars (wrapped Python numbers) in real captures")
    p.add_argument("--colocated", type=whole(1), metavar="CYCLES",
                   help="colocated RL: CYCLES iterations of rollout (modelled) and one training step of --shape, "
                        "with pause/resume of the trainer's and the rollout's tags (docs/colocated.md)")
    p.add_argument("--seed", type=whole(0, (1 << 64) - 1), default=0, help="torch's random seed (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--out", "-o", help="write the trace here (.npt); without it the trace is summarised, not saved")


def run(args: argparse.Namespace) -> int:
    from ..capture import CaptureError, capture
    from ..trace.stats import summarize

    fake = args.fake or args.shape is not None
    if fake and args.shape is None:
        print("npu-pool capture: error: --fake needs --shape (one of 7b, 13b, 70b)", file=sys.stderr)
        return 2
    real_only = [flag for flag, on in (("--dim", args.dim is not None), ("--heads", args.heads is not None),
                                       ("--vocab", args.vocab is not None), ("--seed", args.seed != 0),
                                       ("--keep-host-scalars", args.keep_host_scalars)) if on]
    if fake and real_only:
        print(f"npu-pool capture: error: {', '.join(real_only)} apply to a real capture; a fake one (--fake, --shape) "
              "takes its sizes from the published shape and draws no data", file=sys.stderr)
        return 2
    if not fake and (args.tp > 1 or args.pp > 1):
        print("npu-pool capture: error: --tp and --pp slice a published shape: give --shape (one of 7b, 13b, 70b); "
              "a real capture trains the small model whole", file=sys.stderr)
        return 2
    mp = "bf16" if args.bf16 else None
    progress = not args.no_progress
    if args.out:
        outputs.check(args.out)  # now, not after minutes of training
    try:
        unused = [flag for flag, on in (("--steps", args.steps != DEFAULTS["steps"]), ("--pp", args.pp > 1),
                                        ("--recompute", args.recompute), ("--grad-accum", args.grad_accum > 1),
                                        ("--bf16", args.bf16)) if on]
        if args.colocated is not None and unused:  # (a colocated capture models one step of its own)
            print(f"npu-pool capture: error: --colocated takes --shape, --model, --tp, --batch, --seq and --layers; not "
                  f"{', '.join(unused)}", file=sys.stderr)
            return 2
        if args.colocated is not None and fake:
            from ..capture.colocated import colocated_capture

            trace = colocated_capture(args.colocated, args.model, args.shape, tp=args.tp, batch=args.batch,
                                      seq=args.seq or _FAKE_SEQ, layers=args.layers, progress=progress)
        elif args.colocated is not None:
            print("npu-pool capture: error: --colocated needs --shape (one of 7b, 13b, 70b)",
                  file=sys.stderr)
            return 2
        elif fake:
            from ..capture import fake_capture

            trace = fake_capture(args.model, args.shape, args.steps, args.batch, args.seq or _FAKE_SEQ,
                                 layers=args.layers, tp=args.tp, pp=args.pp, recompute=args.recompute,
                                 grad_accum=args.grad_accum, mixed_precision=mp, progress=progress)
        else:
            trace = capture(args.model, args.steps, args.batch, args.seq or DEFAULTS["seq"],
                            layers=args.layers or DEFAULTS["layers"], dim=args.dim or DEFAULTS["dim"],
                            heads=args.heads or DEFAULTS["heads"], vocab=args.vocab or DEFAULTS["vocab"],
                            recompute=args.recompute, grad_accum=args.grad_accum, mixed_precision=mp,
                            seed=args.seed, keep_host_scalars=args.keep_host_scalars, progress=progress)
    except CaptureError as e:
        print(f"npu-pool capture: error: {e}", file=sys.stderr)
        return 1
    except (MemoryError, RuntimeError) as e:  # the host ran out while building or training the model
        if not isinstance(e, MemoryError) and "can't allocate memory" not in str(e):
            raise
        print("npu-pool capture: error: the host ran out of memory running the model (make it smaller, or capture "
              "a published shape with --fake --shape)", file=sys.stderr)
        return 1
    trace.validate()
    if args.out:
        trace.save(args.out)  # before the summary: a stdout that cannot be written loses nothing
    s = summarize(trace)
    c = trace.meta["capture"]
    what = f"{c['model']}-{c['shape']} (fake, tp {c['tp']}, {c['layers']} layers)" if fake else c["model"]
    micro = "1 micro-batch" if c["grad_accum"] == 1 else f"{c['grad_accum']} micro-batches"
    print(f"captured {what}: {c['steps']} steps x {micro} of {c['batch']}x{c['seq']} tokens,"
          f" recompute {'on' if c['recompute'] else 'off'}, {c['mixed_precision'] or 'fp32'},"
          f" {c['total_s']:.1f} s")
    if c.get("colocated"):
        print(f"colocated RL: {c['cycles']} cycles of rollout (batch {c['rollout_batch']}, {c['prompt']}+{c['response']}"
              f" tokens) and one training step; tags {', '.join(c['tags'])}")
    print(f"events {s['events']}  allocs {s['allocs']}  frees {s['frees']}  marks {s['marks']}"
          f"  sites {len(trace.meta.get('sites', []))}")
    dropped = trace.meta.get("host_scalars_dropped", 0)
    if dropped:
        print(f"left out {dropped} host scalars: 0-dim CPU tensors (Python numbers torch wraps, the optimizer's "
              "per-tensor scalars) that a run on a device keeps in host memory (--keep-host-scalars keeps them)")
    print(f"peak live {fmt_bytes(s['peak_bytes'])} at event {s['peak_event']}; live at end {fmt_bytes(s['end_bytes'])}")
    print("bytes by category at the peak:")
    for name, b in sorted(s["peak_by_category"].items(), key=lambda kv: -kv[1]):
        print(f"  {name:<16} {fmt_bytes(b):>14}  {100 * b / max(1, s['peak_bytes']):5.1f}%")
    print(f"wrote {args.out}" if args.out else "not saved (--out FILE writes the trace)")
    return 0
