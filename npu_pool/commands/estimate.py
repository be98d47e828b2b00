"""``npu-pool estimate``: static memory estimate per rank from a model config, optionally vs a trace."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from typing import Any

_BOOLS = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False, "0": False}


def _bool(s: str) -> bool:
    try:
        return _BOOLS[s.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"expected on/off, not {s!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..analysis.estimate import ModelConfig

    p.add_argument("--config", metavar="YAML", help="config file (field names or Megatron/HF aliases); "
                   "flags below override it")
    p.add_argument("--trace", metavar="TRACE", help="compare with this trace (a capture also supplies the config)")
    p.add_argument("--format", choices=("md", "json"), default="md")
    p.add_argument("--out", "-o", metavar="PATH", help="write here instead of stdout")
    g = p.add_argument_group("model and training (override --config)")
    for f in fields(ModelConfig):
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "str")
        if "bool" in kind:
            g.add_argument(f"--{f.name.replace('_', '-')}", type=_bool, metavar="on|off", dest=f.name)
        elif "int" in kind:
            g.add_argument(f"--{f.name.replace('_', '-')}", type=int, dest=f.name)
        else:
            g.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name)


def _config(args: argparse.Namespace, trace_meta: dict | None):
    from ..analysis.estimate import ModelConfig, config_from_dict, config_from_trace, load_config

    base: dict[str, Any] = {}
    if args.config:
        ignored: list[str] = []
        loaded = load_config(args.config, ignored)
        base = {f.name: getattr(loaded, f.name) for f in fields(ModelConfig)}
        if ignored:
            from ..units import printable

            print(f"npu-pool estimate: {printable(str(args.config))}: set aside, no effect on memory here: "
                  f"{printable(', '.join(ignored))}", file=sys.stderr)
    elif trace_meta is not None:
        cfg = config_from_trace(trace_meta)
        if cfg is not None:
            base = {f.name: getattr(cfg, f.name) for f in fields(ModelConfig)}
    flags = {f.name: getattr(args, f.name) for f in fields(ModelConfig) if getattr(args, f.name, None) is not None}
    merged = {**base, **flags}
    from . import UsageError

    if not merged:
        error = ValueError if trace_meta is not None else UsageError  # (a trace given: it is the trace's fault)
        raise error("give --config YAML, model flags (--hidden --layers --heads --vocab ...), "
                    "or --trace of a capture")
    try:
        return config_from_dict(merged)
    except ValueError as e:  # (the config or trace alone is a valid model: the flags made it wrong)
        if flags:
            raise UsageError(str(e)) from None
        raise


def _md(est, rows) -> str:
    from ..units import fmt_bytes

    c, s = est.config, est.stage
    out = [f"# Static memory estimate (per rank, pipeline stage {s.stage} of {c.pp})", "",
           f"model: hidden {c.hidden}, layers {c.layers}, heads {c.heads} (kv {c.kv_heads or c.heads}), "
           f"ffn {c.ffn_size}, vocab {c.vocab}" + (f", experts {c.experts} top-{c.top_k}" if c.experts else ""),
           f"training: micro-batch {c.micro_batch} x seq {c.seq}, {c.dtype} (activations {c.act_dtype or c.dtype}, "
           f"gradients {'fp32' if c.grad_bytes == 4 else c.grad_dtype or c.dtype}), "
           f"{c.optimizer}{' + fp32 master' if c.master_weights else ''}, ZeRO-{c.zero} "
           f"over DP {c.dp}, TP {c.tp}, PP {c.pp}, EP {c.ep}, recompute {c.recompute}",
           f"parameters: {est.total_params:,} in the model, {s.params:,} on this rank ({s.layers} layers)", "",
           "| figure | bytes |", "|---|---:|"]
    out += [f"| weights | {fmt_bytes(s.weights)} |", f"| gradients | {fmt_bytes(s.gradients)} |",
            f"| optimizer states | {fmt_bytes(s.optimizer_states)} |",
            f"| activations ({s.in_flight} micro-batch{'es' if s.in_flight > 1 else ''} in flight) | "
            f"{fmt_bytes(s.activations)} |", f"| **total** | **{fmt_bytes(s.total)}** |", "",
            f"activations per layer and micro-batch: {fmt_bytes(est.activation_per_layer)} ({est.formula})", ""]
    if len(est.stages) > 1:
        out += ["| stage | layers | weights | gradients | optimizer states | activations | total |",
                "|---:|---:|---:|---:|---:|---:|---:|"]
        out += [f"| {x.stage} | {x.layers} | {fmt_bytes(x.weights)} | {fmt_bytes(x.gradients)} | "
                f"{fmt_bytes(x.optimizer_states)} | {fmt_bytes(x.activations)} | {fmt_bytes(x.total)} |"
                for x in est.stages]
        out.append("")
    if rows is not None:
        out += ["## Estimate vs the trace", "", "| figure | estimated | measured | measured - estimated | ratio |",
                "|---|---:|---:|---:|---:|"]
        for r in rows:
            out.append(f"| {r.figure} | {'-' if r.estimated is None else fmt_bytes(r.estimated)} | "
                       f"{'-' if r.measured is None else fmt_bytes(r.measured)} | "
                       f"{'-' if r.diff is None else fmt_bytes(r.diff)} | "
                       f"{'-' if r.ratio is None else f'{r.ratio:.3f}'} |")
        out += ["", "measured: the trace's highest live bytes of each category; the last row compares the "
                "estimate's sum with the trace's peak live bytes. Temporaries are not estimated."]
    return "\n".join(out) + "\n"


def _warn_mismatch(rows: list, from_config: bool) -> None:
    """One line on stderr when the trace's peak live bytes are off the estimate by more than 10x
    either way: the trace is then not a run of the estimated model, and its ratios say nothing."""
    total = rows[-1] if rows else None
    ratio = total.ratio if total is not None else None
    if ratio is not None and not 0.1 <= ratio <= 10:
        hint = ("the --config describes another model than the traced one: compare a trace of that model, or "
                "leave out --config to estimate the traced model" if from_config else
                "the model flags describe another model than the traced one")
        print(f"npu-pool estimate: warning: the trace's peak live bytes are {ratio:.3g} x the estimate; {hint}",
              file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from ..analysis.estimate import compare, estimate

    named = None
    if args.trace:
        from ..trace.files import open_traces

        named = open_traces(args.trace)
    cfg = _config(args, named[0][1].meta if named else None)
    est = estimate(cfg)
    rows = None
    if named:
        from ..analysis.breakdown import profile_trace

        prof = max((profile_trace(t, n) for n, t in named), key=lambda p: p.peak_live)
        rows = compare(est, prof)
        _warn_mismatch(rows, bool(args.config))
    if args.format == "json":
        d = est.as_dict()
        if rows is not None:
            d["vs_trace"] = [r.as_dict() for r in rows]
        text = json.dumps(d, indent=1) + "\n"
    else:
        text = _md(est, rows)
    if args.out:
        from ..outputs import write_text

        write_text(args.out, text)  # whole or absent
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
