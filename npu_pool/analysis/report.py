"""The analysis of one trace, or of one trace per rank: figures, Markdown and JSON.

Per trace: the live-byte profile (:func:`~npu_pool.analysis.breakdown.profile_trace`)
and, per policy, what the replay reserves (:func:`npu_pool.replay.evaluate`): peak
reserved, utilization (peak live / peak reserved) and waste (peak reserved - peak
live). Several traces (a directory of per-rank traces) add one table across ranks
and the imbalance of each figure (max / mean, and max - min).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable

from ..progress import progress
from ..replay import evaluate, recorded_capacity, recorded_ooms, run
from ..timeline import Timeline, timeline
from ..trace.format import Trace
from ..trace.files import distinct_name, expand, open_traces, repairs, repairs_said
from .breakdown import GROUP_LABELS, GROUPS, TraceProfile, profile_trace
from ..units import fmt_bytes, fmt_share, md_cell, printable

__all__ = ["PolicyFigures", "TraceAnalysis", "Analysis", "analyze_trace", "analyze_paths", "to_json", "to_markdown",
           "imbalance", "rank_groups"]


@dataclass
class PolicyFigures:
    """What one policy reserves for one trace."""

    policy: str
    peak_reserved: int
    utilization: float
    waste: int
    device_mallocs: int
    min_capacity: int | None = None
    peak_reserved_index: int | None = None  # first event at the peak (known with timelines)

    def as_dict(self) -> dict[str, Any]:
        return dict(policy=self.policy, peak_reserved_bytes=self.peak_reserved, utilization=self.utilization,
                    waste_bytes=self.waste, device_mallocs=self.device_mallocs, min_capacity_bytes=self.min_capacity,
                    peak_reserved_index=self.peak_reserved_index)


@dataclass
class RecordedOoms:
    """The requests the recorded run could not serve, and which policies would have, on the
    memory the recorded run had (its segments plus what the device reported free)."""

    sizes: list[int]
    device_free: list[int]
    capacity: int | None
    served: dict[str, int]  # policy -> how many of those requests it served there

    def as_dict(self) -> dict[str, Any]:
        return dict(sizes=self.sizes, device_free=self.device_free, capacity_bytes=self.capacity, served=self.served)


@dataclass
class TraceAnalysis:
    """One trace's profile and per-policy figures (and, when asked for, their timelines)."""

    profile: TraceProfile
    policies: list[PolicyFigures]
    origin: str = ""
    timelines: dict[str, Timeline] = field(default_factory=dict, repr=False)
    ooms: RecordedOoms | None = None
    repairs: list[str] = field(default_factory=list)  # what the importer repaired in the recording
    capture: Any = None  # meta["capture"] of a trace npu-pool capture made: the model's config (estimate)

    @property
    def name(self) -> str:
        return self.profile.name

    def as_dict(self, top_sites: int = 20) -> dict[str, Any]:
        d = self.profile.as_dict(top_sites)
        d["origin"] = self.origin
        d["policies"] = [p.as_dict() for p in self.policies]
        if self.ooms is not None:
            d["recorded_ooms"] = self.ooms.as_dict()
        d["import_repairs"] = list(self.repairs)
        return d


@dataclass
class Analysis:
    """Everything ``npu-pool analyze`` reports about its input."""

    source: str
    traces: list[TraceAnalysis]

    @property
    def ranks(self) -> bool:
        return len(self.traces) > 1

    def worst(self) -> TraceAnalysis:
        """The trace with the highest peak live bytes."""
        return max(self.traces, key=lambda t: t.profile.peak_live)


def analyze_trace(trace: Trace, name: str, policies: Iterable[str], *, min_capacity: bool = False,
                  curves: bool = False, hints: str = "markers",
                  on_step: Callable[[], None] | None = None) -> TraceAnalysis:
    """Profile ``trace`` and replay it through each policy (``curves``: also event by event, for timelines).

    ``on_step`` is called after the profile and after each policy (progress bars)."""
    step = on_step or (lambda: None)
    prof = profile_trace(trace, name)
    step()
    figs, timelines = [], {}
    for policy in policies:
        r = evaluate(trace, name, policy, hints=hints, with_min_capacity=min_capacity)
        f = PolicyFigures(policy, r.peak_reserved_bytes, r.utilization, r.peak_reserved_bytes - r.peak_live_bytes,
                          r.device_mallocs, r.min_capacity_bytes)
        if curves:  # (the report draws reserved bytes: the history, blocks and ranges go, a trace's length
            # of event dicts per policy and trace kept until the page was rendered)
            tl = timelines[policy] = replace(timeline(trace, policy, hints=hints), segment_events=[], blocks=[],
                                             ranges=[], events=[])
            f.peak_reserved_index = tl.peak_reserved_index
        figs.append(f)
        step()
    return TraceAnalysis(prof, figs, str(trace.meta.get("origin", "")), timelines, _recorded_ooms(trace, policies, hints),
                         repairs(trace), trace.meta.get("capture"))


def _recorded_ooms(trace: Trace, policies: Iterable[str], hints: str) -> RecordedOoms | None:
    ooms = recorded_ooms(trace)
    if not ooms:
        return None
    cap = recorded_capacity(trace)
    served = {}
    for policy in policies if cap else ():
        served[policy] = run(trace, policy, cap, hints=hints, probe_ooms=True).ooms_served
    return RecordedOoms([o["size"] for o in ooms], [o["device_free"] for o in ooms], cap, served)


def analyze_paths(paths: list[str], policies: list[str], *, min_capacity: bool = False, curves: bool = False,
                  hints: str = "markers", show_progress: bool | None = None,
                  loaded: Callable[[list[tuple[str, Trace]]], None] | None = None) -> Analysis:
    """Analyze every trace in ``paths`` (files, or directories of per-rank traces); ``loaded`` sees
    them, named, before any replay (a caller's check that would otherwise fail after them)."""
    named: list[tuple[str, Trace]] = []
    source: dict[str, Path] = {}
    for p in progress(expand(paths), desc="load", unit="file", enabled=show_progress):
        for name, t in open_traces(p):
            if name in source and source[name].parent == p.parent:  # a snapshot beside its own import
                raise ValueError(f"{source[name]} and {p} both hold the trace {name}: analyze one of them")
            named.append((distinct_name(name, p, source), t))  # (a/run.npt b/run.npt: told apart by folder)
    if not named:
        raise ValueError("no traces to analyze")
    if any(Path(p).is_dir() for p in paths):
        named.sort(key=lambda nt: _natural(nt[0]))  # rank2 before rank10
    if loaded is not None:
        loaded(named)
    bar = iter(progress(range(len(named) * (1 + len(policies))), desc="analyze", unit="step",
                        enabled=show_progress))
    out = [analyze_trace(t, n, policies, min_capacity=min_capacity, curves=curves, hints=hints,
                         on_step=lambda: next(bar, None)) for n, t in named]
    next(bar, None)  # let the bar see its end (and close)
    return Analysis(", ".join(paths), out)


# -- across ranks -----------------------------------------------------------------------
def rank_groups(a: Analysis) -> list[str]:
    """Category groups with bytes at the peak on some rank (the columns of the rank table)."""
    return [g for g in GROUPS if any(t.profile.at_peak[g] for t in a.traces)]


def _natural(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _rank_metrics(a: Analysis) -> dict[str, list[int]]:
    m: dict[str, list[int]] = {"peak_live": [t.profile.peak_live for t in a.traces]}
    for g in GROUPS:
        vals = [t.profile.at_peak[g] for t in a.traces]
        if any(vals):
            m[f"{g}_at_peak"] = vals
    for k, p in enumerate(a.traces[0].policies):
        m[f"peak_reserved[{p.policy}]"] = [t.policies[k].peak_reserved for t in a.traces]
    return m


def imbalance(a: Analysis) -> list[dict[str, Any]]:
    """Per figure: max (and which rank), min, mean, max/mean and max-min across the traces."""
    names = [t.name for t in a.traces]
    rows = []
    for key, vals in _rank_metrics(a).items():
        hi, lo = max(vals), min(vals)
        mean = sum(vals) / len(vals)
        rows.append(dict(figure=key, max_bytes=hi, max_rank=names[vals.index(hi)], min_bytes=lo,
                         min_rank=names[vals.index(lo)], mean_bytes=mean, max_over_mean=hi / mean if mean else 1.0,
                         spread_bytes=hi - lo))
    return rows


# -- output -------------------------------------------------------------------------------
def to_json(a: Analysis, top_sites: int = 20) -> dict[str, Any]:
    """JSON-ready report (all traces; ``imbalance`` when there are several)."""
    d: dict[str, Any] = {"source": a.source, "traces": [t.as_dict(top_sites) for t in a.traces]}
    if a.ranks:
        d["imbalance"] = imbalance(a)
    return d


def _table(head: list[str], rows: list[list[str]], right: set[int] | None = None) -> list[str]:
    right = right if right is not None else set(range(1, len(head)))
    align = ["---:" if k in right else "---" for k in range(len(head))]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(md_cell(c) for c in r) + " |" for r in rows]
    return lines


_SOURCE_TEXT = {"trace": "from the trace's tensor categories",
                "frames": "inferred from the recorded Python frames of each allocation (the trace has no "
                          "categories): set-up, forward, backward or optimizer code, and whether the tensor outlived "
                          "that stretch",
                "markers": "inferred from phase markers (the trace has no categories)",
                "none": "unknown: the trace has neither categories nor phase markers"}


def _trace_md(t: TraceAnalysis, top_sites: int, level: str = "##") -> list[str]:
    p = t.profile
    out = [f"{level} {md_cell(t.name)}", ""]
    where = (f"at event {p.peak_index} ({100 * p.peak_index / max(1, p.events - 1):.0f}% through the trace)"
             if p.peak_index >= 0 else "(no allocations)")
    out += [f"- events {p.events}, allocations {p.allocs} ({p.initial_allocs} of them live when the recording "
            f"began), frees {p.frees}, sites {len(p.sites)}"
            + (f", origin `{printable(t.origin).replace('`', chr(39))}`" if t.origin else ""),  # (a code span)
            f"- **peak live {fmt_bytes(p.peak_live)}** {where}, phase: {p.peak_phase.describe()}",
            f"- live when the window began {fmt_bytes(p.initial_live)}, at the end {fmt_bytes(p.end_live)}", ""]
    if t.repairs:
        out += [f"- {md_cell(repairs_said(t.repairs))}", ""]
    out += [f"{level}# Fragmentation per policy", ""]
    rows = []
    for f in t.policies:
        rows.append([f.policy, fmt_bytes(f.peak_reserved), f"{100 * f.utilization:.1f}%", fmt_bytes(f.waste),
                     str(f.device_mallocs), "-" if f.min_capacity is None else fmt_bytes(f.min_capacity)])
    out += _table(["policy", "peak reserved", "utilization", "waste", "device mallocs", "min capacity"], rows)
    out += ["", "utilization = peak live / peak reserved; waste = peak reserved - peak live; min capacity = the "
            "smallest device on which the trace completes (by bisection: 2 MiB less fails)"
            + ("" if any(f.min_capacity is not None for f in t.policies) else
               " (`-`: not searched; `npu-pool analyze --min-capacity` finds it, a few replays per policy)") + ".",
            ""]
    if t.ooms is not None:
        o = t.ooms
        out += [f"{level}# Out of memory in the recorded run", ""]
        out += [f"- {len(o.sizes)} request(s) failed: " + ", ".join(
            f"{fmt_bytes(s)} with {fmt_bytes(d)} free on the device" for s, d in list(zip(o.sizes, o.device_free))[:5])]
        if o.capacity:
            out += [f"- on the memory the recorded run had ({fmt_bytes(o.capacity)}: its segments plus the free "
                    "bytes), each policy would have served: " + ", ".join(
                        f"{p} {n} of {len(o.sizes)}" for p, n in o.served.items())]
        out.append("")
    out += [f"{level}# Live bytes at the peak by category", "",
            f"Categories {_SOURCE_TEXT[p.category_source]}."
            + (f" {fmt_share(p.at_peak['unknown'], p.peak_live)} of the peak stays unknown (no frame says what made "
               "it: allocations made by C++ code such as autograd without a Python frame of their own, or live "
               "before the recording began)." if p.category_source == "frames" else ""), ""]
    rows = [[GROUP_LABELS[g], fmt_bytes(p.at_peak[g]), fmt_share(p.at_peak[g], p.peak_live), fmt_bytes(p.group_max[g])]
            for g in GROUPS if p.at_peak[g] or p.group_max[g]]
    out += _table(["category", "at the peak", "share", "highest anywhere"], rows) + [""]
    out += [f"{level}# Top allocation sites", ""]
    rows = [[s.name[:120], fmt_bytes(s.live_at_peak), fmt_bytes(s.total_bytes), str(s.allocs), fmt_bytes(s.largest)]
            for s in p.sites[:top_sites]]
    out += _table(["site", "live at peak", "allocated in total", "allocations", "largest"], rows)
    if len(p.sites) > top_sites:
        out.append(f"\n({len(p.sites) - top_sites} more sites)")
    out.append("")
    if p.layers:
        out += [f"{level}# Forward: live bytes added per layer", ""]
        rows = [[str(L.layer), str(L.passes), fmt_bytes(L.added_mean), fmt_bytes(L.added_max),
                 fmt_bytes(L.transient_max)] for L in p.layers]
        out += _table(["layer", "passes", "added (mean)", "added (max)", "transient high"], rows)
        out += ["", "added = live at layer exit - live at enter (what the layer keeps for backward); "
                "transient high = highest live inside the layer - live at enter.", ""]
    return out


def to_markdown(a: Analysis, top_sites: int = 15) -> str:
    """The report as Markdown: a rank table first when there are several traces."""
    out = [f"# Memory analysis: {md_cell(a.source)}", ""]
    if a.ranks:
        pols = [f.policy for f in a.traces[0].policies]
        groups = rank_groups(a)
        head = ["rank", "peak live", *[f"reserved {p}" for p in pols], *[GROUP_LABELS[g] for g in groups],
                "peak phase"]
        rows = []
        for t in a.traces:
            p = t.profile
            rows.append([t.name, fmt_bytes(p.peak_live), *[fmt_bytes(f.peak_reserved) for f in t.policies],
                         *[fmt_bytes(p.at_peak[g]) for g in groups], p.peak_phase.describe()])
        out += ["## Ranks", ""] + _table(head, rows, set(range(1, len(head) - 1))) + [""]
        out += ["### Imbalance", ""]
        rows = [[r["figure"], fmt_bytes(r["max_bytes"]), r["max_rank"], fmt_bytes(r["min_bytes"]), r["min_rank"],
                 f"{r['max_over_mean']:.3f}", fmt_bytes(r["spread_bytes"])] for r in imbalance(a)]
        out += _table(["figure", "max", "on", "min", "on", "max / mean", "max - min"], rows, {1, 3, 5, 6}) + [""]
        worst = a.worst()
        out += [f"Details of the rank with the highest peak ({md_cell(worst.name)}):", ""]
        out += _trace_md(worst, top_sites, "##")
    else:
        out += _trace_md(a.traces[0], top_sites)
    return "\n".join(out).rstrip() + "\n"
