"""Where a trace's live bytes go: peak, breakdown by category, sites and layers, in one pass.

Live bytes are requested sizes not yet freed (initial allocations included), the
lower bound any allocator must reserve. Categories come from the trace (``cat``)
and are grouped as the report shows them:

==================  =============================================================
group               trace categories
==================  =============================================================
weights             parameter
gradients           gradient
optimizer_states    optimizer_state
activations         activation
temporaries         temporary, autograd_detail
other               input
unknown             unknown
==================  =============================================================

A trace without categories (every allocation ``unknown``, e.g. an imported
snapshot) but with phase markers gets them inferred per allocation from the stage
it was made in and whether it outlived that stage: made during set-up -> weights
(and whatever else set-up creates, e.g. eagerly built optimizer states; so are
allocations before the first iteration when set-up is not marked); freed in the
stage that made it -> temporaries; otherwise forward -> activations, backward
-> gradients, optimizer -> optimizer states, anything else -> other.

A trace without categories whose sites are recorded Python frames (an imported snapshot
recorded with stacks) gets them from the frames first (:func:`frame_kind`): each allocation
site is set-up (a module's ``__init__``, ``reset_parameters``, ``_apply``/``to``/``cuda``,
``load_state_dict``), forward (a ``forward`` or ``_call_impl`` frame), backward (autograd's
``backward``/``_engine_run_backward``/``grad``) or optimizer (``step`` in a file under an
``optim`` path, torch's ``_*_adam*``/``_*_sgd`` functions); consecutive allocations of one
kind form a stage, and the rule above applies with those stages. An allocation with no frame
at all right after forward code is the backward (autograd's engine thread runs no Python).
Sites no frame classifies stay ``unknown`` (the report says how much). Without markers or frames, everything stays
``unknown``.
"""
from __future__ import annotations

import array
from dataclasses import dataclass, field
from typing import Any

from ..trace.format import (CAT_ACTIVATION, CAT_AUTOGRAD_DETAIL, CAT_GRADIENT, CAT_INPUT, CAT_OPTIMIZER_STATE,
                            CAT_PARAMETER, CAT_TEMPORARY, CAT_UNKNOWN, MARK_LAYER_ENTER, MARK_LAYER_EXIT, OP_ALLOC,
                            OP_FREE, OP_INIT_ALLOC, OP_MARK, OP_PAUSE, OP_REGION, OP_RESUME, Trace)
from ..trace.stats import Regions, live_profile
from .phases import NO_STAGE, Phase, PhaseTracker, Span, has_markers, phase_at, stage_spans

__all__ = ["GROUPS", "GROUP_LABELS", "SiteStat", "LayerStat", "TraceProfile", "profile_trace", "group_of_category",
           "frame_kind"]

GROUPS = ("weights", "gradients", "optimizer_states", "activations", "temporaries", "other", "unknown")
GROUP_LABELS = {"weights": "weights", "gradients": "gradients", "optimizer_states": "optimizer states",
                "activations": "activations", "temporaries": "temporaries", "other": "other (inputs ...)",
                "unknown": "unknown"}
_W, _G, _S, _A, _T, _O, _U = range(len(GROUPS))
_CAT_GROUP = {CAT_PARAMETER: _W, CAT_GRADIENT: _G, CAT_OPTIMIZER_STATE: _S, CAT_ACTIVATION: _A,
              CAT_TEMPORARY: _T, CAT_AUTOGRAD_DETAIL: _T, CAT_INPUT: _O, CAT_UNKNOWN: _U}
_STAGE_GROUP = {"setup": _W, "forward": _A, "backward": _G, "optimizer": _S}


def group_of_category(cat: int) -> str:
    """Report group of a trace category (``CAT_*``)."""
    return GROUPS[_CAT_GROUP.get(cat, _U)]


@dataclass
class SiteStat:
    """One allocation site: bytes it holds at the peak and what it allocated in total."""

    site: int
    name: str
    live_at_peak: int
    total_bytes: int
    allocs: int
    largest: int

    def as_dict(self) -> dict[str, Any]:
        return dict(site=self.site, name=self.name, live_at_peak_bytes=self.live_at_peak,
                    total_allocated_bytes=self.total_bytes, allocs=self.allocs, largest_bytes=self.largest)


@dataclass
class LayerStat:
    """Live bytes a layer's forward added (exit - enter) and its transient high (max - enter)."""

    layer: int
    passes: int
    added_mean: float
    added_max: int
    transient_max: int

    def as_dict(self) -> dict[str, Any]:
        return dict(layer=self.layer, passes=self.passes, added_mean_bytes=self.added_mean,
                    added_max_bytes=self.added_max, transient_max_bytes=self.transient_max)


@dataclass
class TraceProfile:
    """Everything :func:`profile_trace` learns about one trace."""

    name: str
    events: int
    allocs: int          # allocations, those live when the recording began included ...
    frees: int
    peak_live: int
    peak_index: int
    peak_phase: Phase
    initial_live: int
    end_live: int
    category_source: str  # "trace", "frames" or "markers" (inferred), or "none"
    at_peak: dict[str, int]  # group -> live bytes at the peak
    group_max: dict[str, int]  # group -> highest live bytes of that group anywhere in the trace
    sites: list[SiteStat]
    layers: list[LayerStat]
    spans: list[Span]
    curve: array.array = field(repr=False)  # live bytes after each event
    initial_allocs: int = 0  # ... these ones

    def as_dict(self, top_sites: int = 20) -> dict[str, Any]:
        """JSON-ready figures (the curve and spans left out)."""
        return dict(trace=self.name, events=self.events, allocs=self.allocs, initial_allocs=self.initial_allocs,
                    frees=self.frees,
                    peak_live_bytes=self.peak_live, peak_index=self.peak_index, peak_phase=self.peak_phase.as_dict(),
                    initial_live_bytes=self.initial_live, end_live_bytes=self.end_live,
                    category_source=self.category_source, at_peak_bytes=dict(self.at_peak),
                    group_max_bytes=dict(self.group_max),
                    top_sites=[s.as_dict() for s in self.sites[:top_sites]], n_sites=len(self.sites),
                    layers=[layer.as_dict() for layer in self.layers])


def _site_names(trace: Trace) -> list[str]:
    return [str(s) for s in trace.meta.get("sites", [])]


_SETUP_FNS = ("__init__", "reset_parameters", "_apply", "to", "cuda", "npu", "load_state_dict", "_load_from_state_dict")
_BACKWARD_FNS = ("backward", "_engine_run_backward", "run_backward", "grad", "_calculate_shape")
_KIND_GROUP = {"setup": _W, "forward": _A, "backward": _G, "optimizer": _S}


def frame_kind(site: str) -> str | None:
    """What made an allocation, from its recorded frames (``file:line:fn < ...``, innermost
    first): "setup", "forward", "backward", "optimizer", or None when no frame says."""
    for part in site.split(" < "):
        bits = part.rsplit(":", 2)
        if len(bits) != 3:
            continue
        path, fn = bits[0].replace("\\", "/").lower(), bits[2]
        if ("optim" in path and fn == "step") or (fn.startswith("_") and ("adam" in fn or "_sgd" in fn)):
            return "optimizer"
        if fn in _BACKWARD_FNS and ("autograd" in path or "_tensor.py" in path or fn != "grad"):
            return "backward"
        if fn in ("forward", "_call_impl", "_wrapped_call_impl"):
            return "forward"
        if fn in _SETUP_FNS and ("nn/modules" in path or fn != "to"):
            return "setup"
    return None


def _site_kinds(trace: Trace) -> list[str | None]:
    return [frame_kind(str(s)) for s in trace.meta.get("sites", [])]


def _category_source(trace: Trace) -> str:
    for op, cat in zip(trace.op, trace.cat):
        if (op == OP_ALLOC or op == OP_INIT_ALLOC) and cat != CAT_UNKNOWN:
            return "trace"
    if any(k is not None for k in _site_kinds(trace)):
        return "frames"
    return "markers" if has_markers(trace) else "none"


def _groups(trace: Trace, source: str) -> bytearray:
    """Report group of every allocation id. Sized by the ids of allocations and frees only: the
    id column of other events holds other values (a marker's argument), which size nothing."""
    ids = (i for op, i in zip(trace.op, trace.id) if op == OP_ALLOC or op == OP_INIT_ALLOC or op == OP_FREE)
    n_ids = max(trace.n_ids, max(ids, default=-1) + 1)
    groups = bytearray([_U]) * n_ids
    if source == "trace":
        for op, cat, id_ in zip(trace.op, trace.cat, trace.id):
            if op == OP_ALLOC or op == OP_INIT_ALLOC:
                groups[id_] = _CAT_GROUP.get(cat, _U)
        return groups
    if source == "frames":
        kinds = _site_kinds(trace)
        born_span = array.array("q", [-1]) * n_ids
        span, last, stage = 0, None, None  # stage: the latest kind a site named (code of no kind between)
        for op, site, id_ in zip(trace.op, trace.site, trace.id):
            if op == OP_ALLOC:
                kind = kinds[site] if 0 <= site < len(kinds) else None
                if site < 0 and stage in ("forward", "backward"):
                    kind = "backward"  # no Python frame after a forward: autograd's engine thread (the loss's
                    # code in between, e.g. cross_entropy in a training step, names no stage)
                elif kind is not None:
                    stage = kind
                if kind != last:
                    span, last = span + 1, kind
                born_span[id_] = span
                groups[id_] = _KIND_GROUP[kind] if kind is not None else _U
            elif op == OP_FREE and born_span[id_] == span and groups[id_] != _U:
                groups[id_] = _T  # died in the stage that made it
        return groups
    if source != "markers":
        return groups
    t = PhaseTracker()
    born_span = array.array("q", [-1]) * n_ids
    for op, cat, id_ in zip(trace.op, trace.cat, trace.id):
        if op == OP_MARK:
            t.mark(cat, id_)
        elif op == OP_ALLOC:
            born_span[id_] = t.span
            before_training = t.stage == NO_STAGE and t.iteration is None
            groups[id_] = _W if before_training else _STAGE_GROUP.get(t.stage, _O)
        elif op == OP_FREE and born_span[id_] == t.span:
            groups[id_] = _T
    return groups


def profile_trace(trace: Trace, name: str = "trace") -> TraceProfile:
    """One pass over ``trace``: peak live, bytes by group at the peak, sites, per-layer forward deltas."""
    peak, peak_index = live_profile(trace)
    source = _category_source(trace)
    groups = _groups(trace, source)
    names = _site_names(trace)
    n_sites = max(len(names), max(trace.site, default=-1) + 1)
    site_live = [0] * (n_sites + 1)  # index -1 -> last slot: unknown site
    site_total = [0] * (n_sites + 1)
    site_count = [0] * (n_sites + 1)
    site_max = [0] * (n_sites + 1)
    glive = [0] * len(GROUPS)
    gmax = [0] * len(GROUPS)
    at_peak_groups, at_peak_sites = list(glive), list(site_live)
    curve = array.array("q", bytes(8 * len(trace)))
    tracker = PhaseTracker()
    open_layers: list[list[int]] = []  # [layer, live at enter, highest live since]
    layer_runs: dict[int, list[tuple[int, int]]] = {}
    live = initial = allocs = frees = n_initial = 0
    # Tagged regions (as live_profile counts them): a paused tag's tensors are off the device until
    # its resume, so they leave every live figure (groups, sites, the curve) meanwhile.
    regions = Regions()

    def move(tag: int, sign: int) -> int:  # a tag's live tensors leave the device (-1) or come back (+1)
        for id_, j in regions.live.get(tag, {}).items():
            glive[groups[id_]] += sign * trace.size[j]
            site_live[trace.site[j]] += sign * trace.size[j]
        return sign * regions.bytes.get(tag, 0)

    for i, (op, cat, site, id_, size) in enumerate(zip(trace.op, trace.cat, trace.site, trace.id, trace.size)):
        if op == OP_ALLOC or op == OP_INIT_ALLOC:
            allocs += 1
            live += size
            if op == OP_INIT_ALLOC:
                initial += size
                n_initial += 1
            g = groups[id_]
            glive[g] += size
            if glive[g] > gmax[g]:
                gmax[g] = glive[g]
            site_live[site] += size
            site_total[site] += size
            site_count[site] += 1
            if size > site_max[site]:
                site_max[site] = size
            for rec in open_layers:
                if live > rec[2]:
                    rec[2] = live
            regions.alloc(id_, i, size)
        elif op == OP_FREE:
            frees += 1
            if regions.free(id_, size):  # (a paused tag's tensor left the device at the pause)
                live -= size
                glive[groups[id_]] -= size
                site_live[site] -= size
        elif op in (OP_REGION, OP_PAUSE, OP_RESUME):
            sign = regions.switch(op, id_)
            if sign:
                live += move(id_, sign)
            if sign > 0:  # (a resume: the tag's tensors count again)
                for g in range(len(GROUPS)):
                    gmax[g] = max(gmax[g], glive[g])
                for rec in open_layers:
                    rec[2] = max(rec[2], live)
        elif op == OP_MARK:
            tracker.mark(cat, id_)
            if cat == MARK_LAYER_ENTER and tracker.stage == "forward":
                open_layers.append([id_, live, live])
            elif cat == MARK_LAYER_EXIT:
                for k in range(len(open_layers) - 1, -1, -1):
                    if open_layers[k][0] == id_:
                        layer, enter, high = open_layers.pop(k)
                        layer_runs.setdefault(layer, []).append((live - enter, high - enter))
                        break
            if not tracker.layers:
                open_layers.clear()
        curve[i] = live
        if i == peak_index:
            at_peak_groups, at_peak_sites = list(glive), list(site_live)
    sites = [SiteStat(s, names[s] if 0 <= s < len(names) else f"site {s}", at_peak_sites[s], site_total[s],
                      site_count[s], site_max[s]) for s in range(n_sites) if site_count[s]]
    if site_count[-1]:
        sites.append(SiteStat(-1, "(unknown site)", at_peak_sites[-1], site_total[-1], site_count[-1], site_max[-1]))
    sites.sort(key=lambda s: (-s.live_at_peak, -s.total_bytes, s.site))
    layers = [LayerStat(k, len(v), sum(a for a, _ in v) / len(v), max(a for a, _ in v), max(h for _, h in v))
              for k, v in sorted(layer_runs.items())]
    peak_phase = phase_at(trace, peak_index + 1) if peak_index >= 0 else Phase()
    return TraceProfile(name=name, events=len(trace), allocs=allocs, frees=frees, peak_live=peak,
                        peak_index=peak_index, peak_phase=peak_phase,
                        initial_live=initial, end_live=live, category_source=source,
                        at_peak={GROUPS[g]: b for g, b in enumerate(at_peak_groups)},
                        group_max={GROUPS[g]: b for g, b in enumerate(gmax)}, sites=sites, layers=layers,
                        spans=stage_spans(trace), curve=curve, initial_allocs=n_initial)
