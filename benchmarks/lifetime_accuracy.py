"""How well npu_pool's learned lifetime classes match what the tensors are.

    python benchmarks/lifetime_accuracy.py [--steps 3] [--markers capture,auto] [--workloads ...]
                                           [--dim D --seq S --batch B --layers L] [--json OUT]

Captures real CPU training with the profiler's tensor categories (``npu_pool.capture``:
gpt, llama with recompute, moe, moe with 2 micro-batches; and, through
``npu_pool.capture.record_trace``, the project's GPT changing sequence length and
evaluating in between, and megatron-core's GPTModel with 2 micro-batches when megatron-core
is installed), replays each trace under the ``npu_pool`` policy as
a device allocator sees it -- markers only, no caller sites (the trace's site column is
dropped, so the core derives sites from the markers) -- and compares the class each
allocation was placed as (``replay.run(..., classes=...)``) with the truth, in bytes:

- ``category``: PARAMETER, GRADIENT, OPTIMIZER_STATE, ACTIVATION, INPUT long; TEMPORARY and
  AUTOGRAD_DETAIL short (the profiler labels backward outputs that are not parameter
  gradients AUTOGRAD_DETAIL: activation gradients and backward scratch; the script prints
  the share of their bytes freed in the backward pass that made them);
- ``saved``: the same, except that an ACTIVATION freed before the forward (or evaluation)
  pass that made it ends is short: the profiler labels every forward op output derived from
  the inputs an activation, also those the forward frees at once (recompute discards all of
  a layer's, an evaluation all of them); only those still live after the forward are
  activations in the memory sense (saved for backward);
- both over all steps and over the steps after the first (``steady``: the core learns a
  site's class when its first block is freed, so the first step runs on per-stage defaults).

Marker sources: ``capture`` (the capture's own markers: iteration, forward, backward,
optimizer, and layer markers in the forward pass only) and ``auto``
(``npu_pool.recorder.attach`` hooks: layer markers in both passes, forward/backward begin
and end, optimizer step; only set-up is marked by hand). Categories with no allocation
are left out; UNKNOWN (memory the profiler cannot name) is not scored.

Peak reserved bytes of the same replay under npu_pool (learned classes), npu_pool with no
classes (``hints="none"``: plain best fit) and torch's allocator model are printed too;
``--dim/--seq/--batch`` make the capture workloads big enough for 2 MiB pages not to hide
differences.
"""
from __future__ import annotations

import argparse
import array
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from npu_pool import replay  # noqa: E402
from npu_pool.trace.format import (CAT_ACTIVATION, CAT_AUTOGRAD_DETAIL, CAT_NAMES, CAT_TEMPORARY,  # noqa: E402
                                   CAT_UNKNOWN, MARK_BACKWARD_BEGIN, MARK_EVAL_BEGIN, MARK_FORWARD_BEGIN,
                                   MARK_ITER_BEGIN, MARK_LAYER_ENTER, MARK_LAYER_EXIT, MARK_OPTIMIZER_BEGIN,
                                   MARK_SETUP_BEGIN, OP_ALLOC, OP_FREE, OP_MARK, Trace)

WORKLOADS = {  # name -> capture() arguments; the last two are run by record_trace (see below)
    "gpt": dict(model_name="gpt"),
    "llama+recompute": dict(model_name="llama", recompute=True),
    "moe": dict(model_name="moe"),
    "moe+accum2": dict(model_name="moe", grad_accum=2),
    "gpt-adapt": None,
    "mcore-gpt+accum2": None,
}
LONG, SHORT = 1, 2
_STAGES = {MARK_SETUP_BEGIN: "setup", MARK_FORWARD_BEGIN: "forward", MARK_BACKWARD_BEGIN: "backward",
           MARK_OPTIMIZER_BEGIN: "optimizer", MARK_EVAL_BEGIN: "eval"}


def _lifetimes(trace: Trace) -> tuple[dict[int, tuple[str, int]], dict[int, bool]]:
    """Per allocation event: (stage it was born in, iteration), and whether it was freed
    in that same stage (same stage instance)."""
    stage, span, it = "outside", 0, -1
    born: dict[int, tuple[int, int]] = {}
    where: dict[int, tuple[str, int]] = {}
    inside: dict[int, bool] = {}
    for i, (op, cat, id_) in enumerate(zip(trace.op, trace.cat, trace.id)):
        if op == OP_MARK and cat not in (MARK_LAYER_ENTER, MARK_LAYER_EXIT):
            span += 1
            stage = _STAGES.get(cat, "outside")
            if cat == MARK_ITER_BEGIN:
                it = id_
        elif op == OP_ALLOC:
            born[id_] = (i, span)
            where[i] = (stage, it)
        elif op == OP_FREE and id_ in born:
            j, s = born.pop(id_)
            inside[j] = s == span
    for j, _ in born.values():
        inside[j] = False
    return where, inside


def score(trace: Trace) -> dict[str, Any]:
    """Replay as a device sees it and score the classes (see the module doc)."""
    t = Trace(meta=trace.meta, op=trace.op, cat=trace.cat, site=array.array("i", [-1]) * len(trace),
              id=trace.id, size=trace.size, stream=trace.stream, addr=trace.addr)
    classes = array.array("B", bytes(len(t)))
    r = replay.run(t, "npu_pool", classes=classes)
    if not r.ok:
        raise RuntimeError(f"replay failed at event {r.fail_index}")
    where, inside = _lifetimes(trace)
    tot: Counter = Counter()
    ok: Counter = Counter()   # keys: (truth, steady, category)
    ad_total = ad_inside = 0
    for i, (op, cat, size) in enumerate(zip(trace.op, trace.cat, trace.size)):
        if op != OP_ALLOC or cat == CAT_UNKNOWN:
            continue
        if cat == CAT_AUTOGRAD_DETAIL:
            ad_total += size
            ad_inside += size if inside[i] else 0
        by_cat = SHORT if cat in (CAT_TEMPORARY, CAT_AUTOGRAD_DETAIL) else LONG
        saved = SHORT if cat == CAT_ACTIVATION and inside[i] and where[i][0] in ("forward", "eval") else by_cat
        steady = where[i][1] >= 1
        for truth, want in (("category", by_cat), ("saved", saved)):
            for scope in ("all", "steady") if steady else ("all",):
                tot[truth, scope, cat] += size
                ok[truth, scope, cat] += size if classes[i] == want else 0
    out: dict[str, Any] = {}
    for truth in ("category", "saved"):
        for scope in ("all", "steady"):
            n = sum(v for (t_, s, _), v in tot.items() if (t_, s) == (truth, scope))
            good = sum(v for (t_, s, _), v in ok.items() if (t_, s) == (truth, scope))
            out[f"{truth}_{scope}"] = good / n if n else 1.0
    out["per_category"] = {CAT_NAMES[c]: ok["category", "all", c] / tot["category", "all", c]
                           for c in sorted({k[2] for k in tot}) if tot["category", "all", c]}
    out["autograd_detail_freed_in_backward"] = ad_inside / ad_total if ad_total else None
    out["npu_pool_reserved"] = r.peak_reserved_bytes
    out["plain_reserved"] = replay.run(t, "npu_pool", hints="none").peak_reserved_bytes
    out["torch_reserved"] = replay.run(t, "torch").peak_reserved_bytes
    out["peak_live"] = r.peak_live_bytes
    return out


def _adapt(steps: int) -> Trace:
    """The project's GPT under attach(): sequence length 128, then 64, then 128 again, an
    evaluation (no grad) after each; the classes must follow new shapes and eval."""
    import torch

    from npu_pool.workloads import build_model
    from npu_pool.recorder import attach
    from npu_pool.capture import record_trace

    def train(rec: Any) -> tuple[Any, Any]:
        torch.manual_seed(0)
        with rec.phase("setup"):
            model = build_model("gpt", n_layers=4, dim=128, n_heads=4, vocab=512, max_seq=128)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        with attach(model, opt, recorder=rec):
            for seq in (128, 64, 128):
                for _ in range(steps):
                    x = torch.randint(512, (4, seq + 1))
                    model(x[:, :-1], x[:, 1:]).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                with torch.no_grad():
                    model(x[:, :-1], x[:, 1:])
        return model, opt

    return record_trace(train, meta={"workload": "gpt-adapt"})


def _mcore(steps: int) -> Trace:
    """megatron-core's GPTModel (TransformerBlock of TransformerLayer) under attach(), two
    micro-batches per step (gradient accumulation), AdamW."""
    import torch

    from npu_pool.recorder import _mcore_cpu as mc
    from npu_pool.recorder import attach
    from npu_pool.capture import record_trace

    mc.init()

    def train(rec: Any) -> tuple[Any, Any]:
        gen = torch.Generator().manual_seed(0)
        with rec.phase("setup"):
            model = mc.gpt(layers=4, hidden=128, heads=4, vocab=512, seq=128)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        with attach(model, opt, recorder=rec):
            for _ in range(steps):
                for _micro in range(2):
                    (mc.loss(model, mc.batch(4, 128, 512, gen)) / 2).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        return model, opt

    return record_trace(train, meta={"workload": "mcore-gpt+accum2"})


def capture(name: str, markers: str, steps: int, shape: dict[str, int] | None = None) -> Trace:
    """The workload's trace with markers from the capture loop or from the recorder
    (``shape``: capture() sizes -- dim, seq, batch, layers -- for the capture workloads)."""
    from npu_pool.capture import capture as rec_capture

    if WORKLOADS[name] is None:
        if markers != "auto":
            raise ValueError(f"{name} is marked by the recorder only (markers 'auto')")
        return {"gpt-adapt": _adapt, "mcore-gpt+accum2": _mcore}[name](steps)
    mode = "loop" if markers == "capture" else markers
    return rec_capture(progress=False, steps=steps, markers=mode, **WORKLOADS[name], **(shape or {}))


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of the scores."""
    head = ("| workload | markers | category, all steps | category, steady | saved, all steps | saved, steady "
            "| npu_pool reserved | npu_pool, no classes | torch reserved |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['markers']} | {r['category_all']:.1%} | {r['category_steady']:.1%} "
                     f"| {r['saved_all']:.1%} | {r['saved_steady']:.1%} | {r['npu_pool_reserved'] / 2**20:.0f} MiB "
                     f"| {r['plain_reserved'] / 2**20:.0f} MiB | {r['torch_reserved'] / 2**20:.0f} MiB |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--markers", default="capture,auto", help="comma-separated: capture, auto, explicit")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--json", metavar="OUT")
    for dim in ("dim", "seq", "batch", "layers"):
        ap.add_argument(f"--{dim}", type=int, help=f"capture workloads: {dim} (default: capture's)")
    args = ap.parse_args(argv)
    rows = []
    t0 = time.time()
    for name in args.workloads.split(","):
        if name not in WORKLOADS:
            ap.error(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
        if name == "mcore-gpt+accum2":
            from npu_pool.recorder import _mcore_cpu

            if not _mcore_cpu.available():
                print(f"{name}: skipped (megatron-core is not installed)", file=sys.stderr)
                continue
        for markers in args.markers.split(","):
            if WORKLOADS[name] is None and markers != "auto":
                continue
            shape = {k: getattr(args, k) for k in ("dim", "seq", "batch", "layers") if getattr(args, k)}
            s = score(capture(name, markers, args.steps, shape))
            rows.append(dict(workload=name, markers=markers, **s))
            print(f"{name} / {markers}: category {s['category_all']:.1%} (steady {s['category_steady']:.1%}), "
                  f"saved {s['saved_all']:.1%} (steady {s['saved_steady']:.1%}); per category "
                  + ", ".join(f"{k} {v:.0%}" for k, v in s["per_category"].items())
                  + (f"; autograd_detail freed in its backward: {s['autograd_detail_freed_in_backward']:.1%}"
                     if s["autograd_detail_freed_in_backward"] is not None else ""), file=sys.stderr)
    print(table(rows))
    print(f"\n({args.steps} steps per capture; {time.time() - t0:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
