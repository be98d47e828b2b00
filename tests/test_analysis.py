"""Analysis: phases, peak breakdown, event-by-event replay, memory_viz export, estimates, reports, OOM snapshots."""
from __future__ import annotations

import array
import base64
import inspect
import json
import os
import pickle
import re
import subprocess
import sys

import pytest

from npu_pool import replay
from npu_pool.analysis import breakdown, estimate as est, memviz
from npu_pool.timeline import Timeline, timeline
from npu_pool.analysis.phases import PhaseTracker, phase_at, stage_spans
from npu_pool.analysis.report import analyze_paths, analyze_trace, imbalance, to_json, to_markdown
from npu_pool.units import fmt_bytes
from npu_pool.cli import main
from npu_pool.pool import OutOfMemoryError, Pool
from npu_pool.trace.format import (CAT_ACTIVATION, CAT_GRADIENT, CAT_INPUT, CAT_OPTIMIZER_STATE, CAT_PARAMETER,
                                   CAT_TEMPORARY, CAT_UNKNOWN, MARK_BACKWARD_BEGIN, MARK_BACKWARD_END,
                                   MARK_FORWARD_BEGIN, MARK_FORWARD_END, MARK_ITER_BEGIN, MARK_ITER_END,
                                   MARK_LAYER_ENTER, MARK_LAYER_EXIT, MARK_OPTIMIZER_BEGIN, MARK_OPTIMIZER_END,
                                   MARK_SETUP_BEGIN, MARK_SETUP_END, OP_ALLOC, OP_EMPTY_CACHE, OP_FREE, OP_INIT_ALLOC, OP_MARK,
                                   OP_PAUSE, OP_REGION, OP_RESUME, Trace)
from npu_pool.trace.snapshot import load_snapshot
from npu_pool.trace.stats import live_profile
from npu_pool.trace.files import open_traces

MiB = 1 << 20
POLICIES = ["torch", "expandable", "npu_pool", "planned"]
SITES = ["model.py:10:init", "data.py:5:batch", "layer.py:20:tmp", "layer.py:30:act", "autograd:grad",
         "optim.py:40:state", "optim.py:50:tmp"]
S_W, S_IN, S_TMP, S_ACT, S_GRAD, S_STATE, S_OTMP = range(len(SITES))


def toy_trace(layers: int = 3, iters: int = 2, w: int = 1 * MiB, act: int = 3 * MiB, tmp: int = 2 * MiB,
              inp: int = 64 << 10, *, empty_cache: bool = False) -> Trace:
    """A marked training run: weights in set-up; per iteration an input, per layer a temporary and a kept
    activation, backward making a gradient per layer and freeing activations, Adam states made in the
    first optimizer step, zero_grad freeing gradients."""
    t = Trace(meta={"origin": "toy", "sites": list(SITES)})
    nid = 0

    def alloc(size: int, cat: int, site: int) -> int:
        nonlocal nid
        t.append(OP_ALLOC, id=nid, size=size, cat=cat, site=site)
        nid += 1
        return nid - 1

    def free(i: int) -> None:
        k = list(t.id).index(i)  # the alloc of id i
        t.append(OP_FREE, id=i, size=t.size[k], cat=t.cat[k], site=t.site[k])

    t.append(OP_MARK, cat=MARK_SETUP_BEGIN)
    for _ in range(layers):
        alloc(w, CAT_PARAMETER, S_W)
    t.append(OP_MARK, cat=MARK_SETUP_END)
    for it in range(iters):
        t.append(OP_MARK, cat=MARK_ITER_BEGIN, id=it)
        x = alloc(inp, CAT_INPUT, S_IN)
        t.append(OP_MARK, cat=MARK_FORWARD_BEGIN, id=0)
        acts = []
        for layer in range(layers):
            t.append(OP_MARK, cat=MARK_LAYER_ENTER, id=layer)
            scratch = alloc(tmp, CAT_TEMPORARY, S_TMP)
            acts.append(alloc(act, CAT_ACTIVATION, S_ACT))
            free(scratch)
            t.append(OP_MARK, cat=MARK_LAYER_EXIT, id=layer)
        t.append(OP_MARK, cat=MARK_FORWARD_END, id=0)
        t.append(OP_MARK, cat=MARK_BACKWARD_BEGIN, id=0)
        grads = []
        for a in reversed(acts):
            grads.append(alloc(w, CAT_GRADIENT, S_GRAD))
            free(a)
        t.append(OP_MARK, cat=MARK_BACKWARD_END, id=0)
        free(x)
        t.append(OP_MARK, cat=MARK_OPTIMIZER_BEGIN, id=it)
        if it == 0:
            for _ in range(2 * layers):
                alloc(w, CAT_OPTIMIZER_STATE, S_STATE)
        free(alloc(w, CAT_TEMPORARY, S_OTMP))
        for g in grads:
            free(g)
        t.append(OP_MARK, cat=MARK_OPTIMIZER_END, id=it)
        t.append(OP_MARK, cat=MARK_ITER_END, id=it)
        if empty_cache:
            t.append(OP_EMPTY_CACHE)
    t.meta["n_ids"] = nid
    t.validate()
    return t


def strip_categories(t: Trace) -> Trace:
    out = Trace(meta=dict(t.meta), op=t.op, site=t.site, id=t.id, size=t.size, stream=t.stream, addr=t.addr,
                cat=array.array("B", (c if op == OP_MARK else CAT_UNKNOWN for op, c in zip(t.op, t.cat))))
    return out


@pytest.fixture(scope="module")
def captured() -> Trace:
    from npu_pool.capture import capture

    return capture("gpt", steps=1, batch=2, seq=64, progress=False)


# -- phases ------------------------------------------------------------------------------------
def test_phases_follow_the_markers():
    t = toy_trace(layers=3, iters=2)
    first_grad = next(i for i, (op, c) in enumerate(zip(t.op, t.cat)) if op == OP_ALLOC and c == CAT_GRADIENT)
    p = phase_at(t, first_grad)
    assert (p.stage, p.iteration, p.micro, p.layer) == ("backward", 0, 0, None)
    assert "iteration 0" in p.describe() and "backward of micro-batch 0" in p.describe()
    first_act = next(i for i, (op, c) in enumerate(zip(t.op, t.cat)) if op == OP_ALLOC and c == CAT_ACTIVATION)
    assert phase_at(t, first_act).layer == 0 and phase_at(t, first_act).stage == "forward"
    spans = stage_spans(t)
    stages = [s.stage for s in spans if s.stage != "step"]
    assert stages == ["setup"] + ["forward", "backward", "optimizer"] * 2
    assert all(a.end <= b.start for a, b in zip(spans, spans[1:]))
    assert phase_at(Trace(), 0).describe() == "no phase markers"


def test_tracker_spans_change_only_with_stages():
    tr = PhaseTracker()
    tr.mark(MARK_ITER_BEGIN, 5)
    before = tr.span
    tr.mark(MARK_LAYER_ENTER, 1)
    assert tr.span == before and tr.phase.layer == 1 and tr.iteration == 5
    tr.mark(MARK_FORWARD_BEGIN, 2)
    assert tr.span == before + 1 and tr.phase.micro == 2


# -- breakdown ----------------------------------------------------------------------------------
def test_breakdown_of_the_toy_peak():
    L, W, A, T, I = 3, 1 * MiB, 3 * MiB, 2 * MiB, 64 << 10
    t = toy_trace(L, 2, W, A, T, I)
    p = breakdown.profile_trace(t, "toy")
    assert (p.peak_live, p.peak_index) == tuple(live_profile(t))
    # the peak: second iteration (states exist), last layer's forward, its temporary still live
    assert p.peak_phase.iteration == 1 and p.peak_phase.stage == "forward" and p.peak_phase.layer == L - 1
    assert p.at_peak == {"weights": L * W, "gradients": 0, "optimizer_states": 2 * L * W, "activations": L * A,
                         "temporaries": T, "other": I, "unknown": 0}
    assert sum(p.at_peak.values()) == p.peak_live
    assert p.group_max["gradients"] == L * W and p.category_source == "trace"
    by_name = {s.name: s for s in p.sites}
    assert sum(s.live_at_peak for s in p.sites) == p.peak_live
    assert by_name[SITES[S_ACT]].total_bytes == 2 * L * A and by_name[SITES[S_ACT]].allocs == 2 * L
    assert by_name[SITES[S_TMP]].largest == T
    assert p.sites[0].live_at_peak == max(s.live_at_peak for s in p.sites)
    assert [(x.layer, x.passes, x.added_max, x.transient_max) for x in p.layers] == \
        [(k, 2, A, A + T) for k in range(L)]
    assert p.end_live == 3 * L * W  # weights and states


def test_a_paused_regions_tensors_leave_the_breakdown_until_its_resume():
    """A colocated run (docs/colocated.md): the training weights' region paused while a rollout's
    activations fill the device. The peak is the rollout's alone, and so is what the breakdown,
    the sites and the curve show there (they once counted the paused weights too: 162% of the peak)."""
    t = Trace(meta={"n_ids": 4, "sites": ["model.py:10 (weights)", "rollout.py:20 (generate)"]})
    t.append(OP_REGION, id=0)
    t.append(OP_ALLOC, id=0, size=100 * MiB, cat=CAT_PARAMETER, site=0)
    t.append(OP_REGION, id=-1)
    t.append(OP_PAUSE, id=0, cat=1)
    t.append(OP_ALLOC, id=1, size=160 * MiB, cat=CAT_ACTIVATION, site=1)
    t.append(OP_FREE, id=1, size=160 * MiB, site=1)
    t.append(OP_RESUME, id=0)
    t.append(OP_REGION, id=0)
    t.append(OP_ALLOC, id=2, size=10 * MiB, cat=CAT_ACTIVATION, site=1)
    t.append(OP_REGION, id=-1)
    t.append(OP_PAUSE, id=0, cat=1)
    t.append(OP_FREE, id=2, size=10 * MiB, site=1)  # (freed while paused: it left the device at the pause)
    t.append(OP_ALLOC, id=3, size=1 * MiB, cat=CAT_ACTIVATION, site=1)
    t.validate("colocated")
    p = breakdown.profile_trace(t, "colocated")
    assert (p.peak_live, p.peak_index) == tuple(live_profile(t)) == (160 * MiB, 4)
    assert p.at_peak["activations"] == 160 * MiB and p.at_peak["weights"] == 0
    assert sum(p.at_peak.values()) == sum(s.live_at_peak for s in p.sites) == p.peak_live
    assert [c // MiB for c in p.curve] == [0, 100, 100, 0, 160, 0, 100, 100, 110, 110, 0, 0, 1]
    assert p.group_max["weights"] == 100 * MiB and p.end_live == 1 * MiB  # (the weights paused at the end)


def test_categories_inferred_from_markers():
    t = toy_trace()
    truth = breakdown.profile_trace(t)
    guess = breakdown.profile_trace(strip_categories(t))
    assert guess.category_source == "markers"
    for g in ("weights", "optimizer_states", "activations", "temporaries", "other"):
        assert guess.at_peak[g] == truth.at_peak[g], g
    assert guess.group_max["gradients"] == truth.group_max["gradients"]


def test_without_categories_or_markers_everything_is_unknown():
    t = toy_trace()
    keep = [i for i, op in enumerate(t.op) if op != OP_MARK]
    bare = Trace(meta=dict(t.meta))
    for i in keep:
        bare.append(t.op[i], id=t.id[i], size=t.size[i], site=t.site[i], cat=CAT_UNKNOWN)
    p = breakdown.profile_trace(bare)
    assert p.category_source == "none" and p.at_peak["unknown"] == p.peak_live and not p.layers
    assert p.peak_phase.describe() == "no phase markers"


def test_a_peak_before_the_first_marker_is_outside_the_marked_stages(tmp_path) -> None:
    """An imported snapshot whose annotations mark only the optimizer, peaking before it: the JSON,
    HTML and ranks table said "no phase markers" (the markdown alone said this)."""
    t = Trace(meta={"n_ids": 2, "sites": []})
    t.append(OP_ALLOC, id=0, size=8 << 20)
    t.append(OP_FREE, id=0, size=8 << 20)
    t.append(OP_MARK, cat=MARK_OPTIMIZER_BEGIN, id=-1)
    t.append(OP_ALLOC, id=1, size=1 << 20)
    t.append(OP_MARK, cat=MARK_OPTIMIZER_END, id=-1)
    p = breakdown.profile_trace(t)
    assert p.peak_index == 0 and p.peak_phase.describe() == "outside the marked stages"
    t.save(tmp_path / "t.npt")
    (tr,) = to_json(analyze_paths([str(tmp_path / "t.npt")], ["npu_pool"], show_progress=False), 5)["traces"]
    assert tr["peak_phase"]["text"] == "outside the marked stages"


# -- timelines: the core's history of a replay ------------------------------------------------------------
def _check_timeline(t: Trace, policy: str) -> Timeline:
    tl = timeline(t, policy)
    placed = array.array("Q", bytes(8 * len(t)))
    r = replay.run(t, policy, placed=placed)
    assert tl.ok
    # the core recorded the same placements as the plain replay made, each at its trace event
    assert [(e["time"], e["addr"]) for e in tl.events if e["kind"] == "alloc"] == [
        (i, a) for i, (op, a) in enumerate(zip(t.op, placed)) if op in (OP_ALLOC, OP_INIT_ALLOC)]
    assert tl.peak_reserved == r.peak_reserved_bytes == max(tl.reserved)
    assert tl.reserved[tl.peak_reserved_index] == tl.peak_reserved
    assert sum(size for _, size in tl.ranges) == tl.reserved[-1] == r.stats["total"]["reserved"]["current"]
    return tl


@pytest.mark.parametrize("policy", POLICIES)
def test_timeline_matches_replay(policy):
    tl = _check_timeline(toy_trace(empty_cache=True), policy)
    kinds = {e["kind"] for e in tl.segment_events}
    assert kinds <= ({"segment_alloc", "segment_free"} if policy == "torch" else {"segment_map", "segment_unmap"})


def test_timeline_of_a_failed_replay_stops_at_the_request():
    t = toy_trace()
    need = replay.run(t, "npu_pool").peak_live_bytes
    tl = timeline(t, "npu_pool", capacity=need // 2)
    assert not tl.ok and 0 <= tl.fail_index < len(t) and t.op[tl.fail_index] in (OP_ALLOC, OP_INIT_ALLOC)
    oom, = [e for e in tl.events if e["kind"] == "oom"]
    assert oom["time"] == tl.fail_index and oom["size"] == t.size[tl.fail_index]
    assert max(tl.reserved) <= need // 2 and not any(tl.reserved[tl.fail_index:])


def test_timeline_of_a_real_trace_with_cache_releases(shared_traces):
    (_, t), = open_traces(shared_traces / "llama7b-offload-infer.pickle")
    for policy in POLICIES:
        tl = _check_timeline(t, policy)
        gone = [e for e in tl.segment_events if e["kind"] in ("segment_free", "segment_unmap")]
        assert gone, policy  # the recorded empty_cache runs release memory under every policy


# -- memory_viz export -----------------------------------------------------------------------------------
def _memviz():
    from torch.cuda import _memory_viz

    return _memory_viz


def test_export_refuses_the_planned_policy_without_a_plan(tmp_path) -> None:
    """Without a plan the planned policy is the npu_pool policy: an export 'under planned' would
    show npu_pool's memory under planned's name, so it is refused, saying what plans a trace."""
    with pytest.raises(ValueError, match="needs a plan made from the trace"):
        memviz.snapshot_of([toy_trace()], "planned")
    with pytest.raises(ValueError, match="needs a plan made from the trace"):
        memviz.export([toy_trace()], "planned", tmp_path / "x.pickle")
    assert not (tmp_path / "x.pickle").exists()


@pytest.mark.parametrize("rules", ["npu", "cuda"])
def test_a_pools_snapshot_says_the_reserved_memory_at_no_address(rules: str) -> None:
    """A trim under the cap keeps unmapped chunks as spares (in reserved): a snapshot's segments,
    the mapped memory, added up to 84 MiB where memory_reserved() said 102 (a review through
    torch_npu's memory APIs, 2026-11-27). allocator_settings' npu_pool_unmapped_bytes says the rest."""
    from npu_pool.snapshot import pool_snapshot

    MiB = 1 << 20
    with Pool("npu_pool", capacity=1 << 30, rules=rules) as p:
        p.set_fraction(0.125)
        p.malloc(70 * MiB)
        p.free(p.malloc(20 * MiB))
        p.malloc(10 * MiB)
        st = p.stats()
        assert st["spare"] > 0
        snap = pool_snapshot({0: p})
        held = snap["allocator_settings"]["npu_pool_unmapped_bytes"]
        assert held == {0: st["spare"]}
        assert sum(s["total_size"] for s in snap["segments"]) + held[0] == st["total"]["reserved"]["current"]
        p.empty_cache()
        assert pool_snapshot({0: p})["allocator_settings"]["npu_pool_unmapped_bytes"] == {}


@pytest.mark.parametrize("policy", memviz.POLICIES[:-1])  # the pool policies ("recorded": below)
def test_export_opens_in_memory_viz(policy, tmp_path):
    t = toy_trace(empty_cache=True)
    snap = memviz.snapshot_of([t], policy)
    mv = _memviz()
    text = mv.segsum(snap)  # asserts every segment's blocks add up
    reserved = sum(s["total_size"] for s in snap["segments"])
    assert reserved == timeline(t, policy).reserved[-1]
    assert f"segments: {len(snap['segments'])}" in text
    events = snap["device_traces"][0]
    n_alloc = sum(1 for op in t.op if op == OP_ALLOC)
    assert sum(e["action"] == "alloc" for e in events) == n_alloc
    assert sum(e["action"] == "free_completed" for e in events) == sum(1 for op in t.op if op == OP_FREE)
    assert mv.trace(snap).count(" = ") >= n_alloc
    live = {b["address"] for seg in snap["segments"] for b in seg["blocks"] if b["state"] == "active_allocated"}
    open_ = {}
    for e in events:
        if e["action"] == "alloc":
            open_[e["addr"]] = e
        elif e["action"] == "free_completed":
            open_.pop(e["addr"])
    assert set(open_) == live  # the end state holds exactly what the events leave allocated
    # each block keeps its allocation's frames (under the phase markers the pool knows no site:
    # every end-state block was written without frames; a helper's review)
    active = [b for seg in snap["segments"] for b in seg["blocks"] if b["state"] == "active_allocated"]
    assert active and all(b["frames"] for b in active)
    assert all(b["frames"] == open_[b["address"]]["frames"] for b in active if b["address"] in open_)
    # the project's own importer reads it back: same requested sizes, same peak
    path = memviz.write_snapshot(snap, tmp_path / "x.pickle")
    back, = load_snapshot(path)
    assert live_profile(back).peak_bytes == live_profile(t).peak_bytes
    assert {a["name"] for a in snap["external_annotations"]} >= {"forward 0", "layer 2", "optimizer 1"}


def test_export_cli_and_memory_viz_cli(tmp_path):
    t = toy_trace()
    src = tmp_path / "toy.npt"
    t.save(src)
    assert main(["export", str(src), "--out", str(tmp_path / "x.npt")]) == 2  # a snapshot named as a trace: exit 2
    assert not (tmp_path / "x.npt").exists()
    out = tmp_path / "toy.pickle"
    assert main(["export", str(src), "--policy", "npu_pool", "--out", str(out)]) == 0
    r = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "stats", str(out)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    reserved = timeline(t, "npu_pool").reserved[-1]
    assert f"total_reserved: {_memviz()._format_size(reserved)}" in r.stdout
    html = tmp_path / "plot.html"
    r = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", str(out), "-o", str(html)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    blob = json.loads(re.search(r"const local_files = (\[.*?\])\n", html.read_text()).group(1))[0]["base64"]
    assert pickle.loads(base64.b64decode(blob)) == pickle.loads(out.read_bytes())


def test_export_recorded_addresses_round_trip(shared_traces, tmp_path):
    path = shared_traces / "cs336-forward-fp32.pickle"
    t, = load_snapshot(path)
    snap = memviz.snapshot_of([t], "recorded")
    _memviz().segsum(snap)
    allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
    assert [e["addr"] for e in allocs] == [a for op, a in zip(t.op, t.addr) if op == OP_ALLOC]
    back, = load_snapshot(memviz.write_snapshot(snap, tmp_path / "r.pickle"))
    assert live_profile(back).peak_bytes == live_profile(t).peak_bytes
    with pytest.raises(ValueError, match="no recorded addresses"):
        memviz.snapshot_of([toy_trace()], "recorded")


def _totals(snap: dict) -> tuple[int, int, int]:
    """(reserved, allocated, active blocks) of a snapshot's end state."""
    blocks = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    return sum(s["total_size"] for s in snap["segments"]), sum(b["size"] for b in blocks), len(blocks)


def test_export_recorded_keeps_expandable_segments_whole(tmp_path):
    """An imported snapshot of expandable segments (ranges mapped and unmapped piece by piece)
    exported back with its own addresses: each mapped piece became a segment of its own, a block
    spanning two pieces was cut short (its rest shown free: 387.5 of 499.5 MiB allocated on
    cs336-forward-fp32) and an unmap of part of a range was never applied (a helper's review).
    Mapped pieces that touch are one segment now, an unmap cuts it, and the totals are the source's."""
    t = toy_trace(empty_cache=True)
    src = memviz.write_snapshot(memviz.snapshot_of([t], "expandable"), tmp_path / "x.pickle")
    first = pickle.loads(src.read_bytes())
    assert any(e["action"] == "segment_map" for e in first["device_traces"][0])
    back, = load_snapshot(src)
    again = memviz.snapshot_of([back], "recorded")
    _memviz().segsum(again)
    assert _totals(again) == _totals(first)
    assert all(s["is_expandable"] for s in again["segments"])
    MiB = 1 << 20  # a range mapped whole, then its upper half unmapped
    a = 1 << 32
    ev = [{"action": "segment_map", "addr": a, "size": 40 * MiB, "stream": 0, "frames": [], "time_us": 0},
          {"action": "alloc", "addr": a, "size": 8 * MiB, "stream": 0, "frames": [], "time_us": 1},
          {"action": "segment_unmap", "addr": a + 20 * MiB, "size": 20 * MiB, "stream": 0, "frames": [], "time_us": 2}]
    seg = {"device": 0, "address": a, "total_size": 20 * MiB, "allocated_size": 8 * MiB, "active_size": 8 * MiB,
           "requested_size": 8 * MiB, "stream": 0, "segment_type": "large", "is_expandable": True, "frames": [],
           "blocks": [{"address": a, "size": 8 * MiB, "requested_size": 8 * MiB, "state": "active_allocated",
                       "frames": []},
                      {"address": a + 8 * MiB, "size": 12 * MiB, "requested_size": 0, "state": "inactive",
                       "frames": []}]}
    cut = tmp_path / "cut.pickle"
    cut.write_bytes(pickle.dumps({"segments": [seg], "device_traces": [ev],
                                  "allocator_settings": {"expandable_segments": True}}))
    t2, = load_snapshot(cut)
    snap = memviz.snapshot_of([t2], "recorded")
    assert _totals(snap) == (20 * MiB, 8 * MiB, 1)
    assert [e["action"] for e in snap["device_traces"][0]] == ["segment_map", "alloc", "segment_unmap"]


def test_repairs_made_on_import_are_said_by_analyze_and_replay(tmp_path, capsys):
    """A snapshot the importer had to repair (a block allocated again at a live address: the old
    one freed first) was analysed and replayed without a word; only `import` said "(N warnings in
    meta)". analyze's reports and replay name the repairs."""
    MiB = 1 << 20
    ev = [{"action": "alloc", "addr": 1 << 24, "size": MiB, "stream": 0, "frames": [], "time_us": k} for k in (1, 2)]
    src = tmp_path / "fixed.pickle"
    src.write_bytes(pickle.dumps({"segments": [], "device_traces": [ev]}))
    a = analyze_paths([str(src)], ["npu_pool"], show_progress=False)
    (t,) = a.traces
    assert t.repairs and "still live" in t.repairs[0]
    assert to_json(a)["traces"][0]["import_repairs"] == t.repairs
    assert "the recording was repaired on import (1): event 1: alloc at 0x1000000 which is still live" in to_markdown(a)
    assert main(["replay", str(src), "--policy", "torch", "--no-min-capacity"]) == 0
    assert "note: fixed: the recording was repaired on import (1)" in capsys.readouterr().err


def test_export_recorded_keeps_the_runs_failed_requests(tmp_path):
    """A recorded out-of-memory (a failed request, with the device's free bytes) was left out of
    the recorded export, so the exported snapshot, imported again, had lost it (a helper's review)."""
    MiB = 1 << 20
    entries = [{"action": "alloc", "addr": 1 << 30, "size": 3 * MiB, "stream": 0, "frames": [], "time_us": 1},
               {"action": "oom", "size": 64 * MiB, "device_free": 5 * MiB, "stream": 0, "frames": [], "time_us": 2},
               {"action": "free_completed", "addr": 1 << 30, "size": 3 * MiB, "stream": 0, "frames": [], "time_us": 3}]
    src = tmp_path / "oom.pickle"
    src.write_bytes(pickle.dumps({"segments": [], "device_traces": [entries]}))
    t, = load_snapshot(src)
    assert t.ooms() and t.ooms()[0]["device_free"] == 5 * MiB
    back, = load_snapshot(memviz.write_snapshot(memviz.snapshot_of([t], "recorded"), tmp_path / "r.pickle"))
    assert back.ooms() == t.ooms()


@pytest.mark.parametrize("policy", ["torch", "expandable", "npu_pool"])
def test_a_failed_request_counts_in_no_figure_and_exports_as_failed(tmp_path, policy):
    """A request the recorded run could not serve (an OOM snapshot's last entry, the case users
    analyze most) was tried by every replay and served on the 1 TiB device: 30 GiB of peak
    reserved beside 0.1 GiB peak live (utilization 0.3%), and an export under a policy wrote it
    as a tensor that never existed (imported again: peak live 30 GiB). A review found it (a
    helper). Only the question for the recorded run's memory tries it (would this policy serve
    it?); export keeps it as the recorded run's failure."""
    MiB = 1 << 20
    entries = [{"action": "alloc", "addr": 1 << 30, "size": 100 * MiB, "stream": 0, "frames": [], "time_us": 1},
               {"action": "oom", "size": 30 << 30, "device_free": 1 << 30, "stream": 0, "frames": [], "time_us": 2},
               {"action": "free_completed", "addr": 1 << 30, "size": 100 * MiB, "stream": 0, "frames": [], "time_us": 3}]
    src = tmp_path / "oom.pickle"
    src.write_bytes(pickle.dumps({"segments": [], "device_traces": [entries]}))
    t, = load_snapshot(src)
    r = replay.evaluate(t, "oom", policy)
    assert r.peak_live_bytes == 100 * MiB <= r.peak_reserved_bytes < 200 * MiB
    assert r.min_capacity_bytes is not None and r.min_capacity_bytes < 200 * MiB
    a = analyze_trace(t, "oom", [policy])
    assert a.ooms is not None and a.ooms.served == {policy: 0}  # 30 GiB on the recorded 1 GiB: none would
    tl = timeline(t, policy)
    assert tl.peak_reserved < 200 * MiB
    back, = load_snapshot(memviz.write_snapshot(memviz.snapshot_of([t], policy), tmp_path / "e.pickle"))
    failed = lambda x: [(o["size"], o["device_free"]) for o in x.ooms()]  # noqa: E731 (the export adds segment events)
    assert failed(back) == failed(t) == [(30 << 30, 1 << 30)] and live_profile(back).peak_bytes == 100 * MiB


def test_site_frames_parse_imported_and_captured_sites():
    f = memviz.site_frames("a/b.py:12:fn < c/d.py:3:g")
    assert [(x["filename"], x["line"], x["name"]) for x in f] == [("a/b.py", 12, "fn"), ("c/d.py", 3, "g")]
    assert memviz.site_frames("Linear:aten::linear>aten::addmm")[0]["name"] == "Linear:aten::linear>aten::addmm"
    # an .npt's site is not bounded: what the export keeps of one is (a 1 MB site of 250,000 parts
    # made a 101 MB export of a 4.8 MB trace)
    huge = memviz.site_frames(" < ".join(f"{'d' * 300}/f.py:{'9' * 5000}:{'n' * 300}" for _ in range(250_000)))
    assert len(huge) == memviz.SITE_FRAMES
    assert all(len(x["filename"]) <= memviz.SITE_TEXT and len(x["name"]) <= memviz.SITE_TEXT for x in huge)


# -- static estimate ----------------------------------------------------------------------------------
def _dense(**kw) -> est.ModelConfig:
    base = dict(hidden=1024, layers=8, heads=16, vocab=32000, seq=2048, micro_batch=2, dtype="bf16")
    return est.ModelConfig(**{**base, **kw})


def test_activations_follow_korthikanti():
    c = _dense()
    s, b, h, a = c.seq, c.micro_batch, c.hidden, c.heads
    assert est.estimate(c).activation_per_layer == s * b * h * (34 + 5 * a * s / h)
    for t in (2, 4):
        assert est.estimate(_dense(tp=t)).activation_per_layer == s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
        assert est.estimate(_dense(tp=t, sequence_parallel=True)).activation_per_layer == \
            s * b * h / t * (34 + 5 * a * s / h)
    assert est.estimate(_dense(recompute="selective")).activation_per_layer == s * b * h * 34
    assert est.estimate(_dense(recompute=True)).activation_per_layer == 2 * s * b * h
    flash = est.estimate(_dense(flash_attention=True)).activation_per_layer
    assert s * b * h * 34 < flash < s * b * h * 35


def test_bytes_per_parameter_and_zero_stages():
    """ZeRO's 2 + 2 + 12 bytes for fp16; bf16 gradients in fp32, as Megatron keeps them (2 + 4 + 12,
    its theoretical estimate's 18; they were counted at 2 bytes, 27% under Megatron's figure for
    Llama-2-7B with the distributed optimizer over 8 ranks: a review, 2026-11-27)."""
    n = est.estimate(_dense()).stage.params
    fp16 = est.estimate(_dense(dtype="fp16", optimizer="adam")).stage
    assert (fp16.weights, fp16.gradients, fp16.optimizer_states) == (2 * n, 2 * n, 12 * n)
    bf16 = est.estimate(_dense(optimizer="adam")).stage
    assert (bf16.weights, bf16.gradients, bf16.optimizer_states) == (2 * n, 4 * n, 12 * n)
    assert est.estimate(_dense(grad_dtype="bf16")).stage.gradients == 2 * n
    assert est.config_from_dict(dict(hidden=64, layers=2, heads=4, vocab=100,
                                     accumulate_allreduce_grads_in_fp32=True, dtype="fp16")).grad_bytes == 4
    fp32 = est.estimate(_dense(dtype="fp32")).stage
    assert (fp32.weights, fp32.gradients, fp32.optimizer_states) == (4 * n, 4 * n, 8 * n)
    dp = 8
    z = [est.estimate(_dense(zero=k, dp=dp)).stage for k in range(4)]
    assert z[1].optimizer_states == 12 * n // dp and z[1].gradients == 4 * n
    assert z[2].gradients == 4 * n // dp and z[2].weights == 2 * n
    assert z[3].weights == 2 * n // dp
    assert [x.total for x in z] == sorted((x.total for x in z), reverse=True)


def test_zero_shards_experts_over_the_expert_data_parallel_group():
    """Expert parameters are sharded over dp / ep ranks (the expert data-parallel group), the rest
    over dp: a Mixtral-like model at ep 8, dp 8, ZeRO-1 had its optimizer states divided by 8
    whole, 6.5 times too few (a review, 2026-11-27)."""
    moe = dict(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=32000, gated_mlp=True, bias=False,
               norm="rmsnorm", position="rope", experts=8, top_k=2)
    one = est.estimate(est.ModelConfig(**moe, ep=8, dp=8)).stage  # no ZeRO
    experts = 32 * est._expert_params(est.ModelConfig(**moe, ep=8, dp=8).checked())
    z1 = est.estimate(est.ModelConfig(**moe, ep=8, dp=8, zero=1)).stage
    assert z1.optimizer_states == (one.params - experts) * 12 // 8 + experts * 12 // 1
    z3 = est.estimate(est.ModelConfig(**moe, ep=2, dp=8, zero=3)).stage
    experts2 = 32 * est._expert_params(est.ModelConfig(**moe, ep=2, dp=8).checked())
    assert z3.weights == (z3.params - experts2) * 2 // 8 + experts2 * 2 // 4
    with pytest.raises(ValueError, match="ep=8 does not divide dp=4"):
        est.estimate(est.ModelConfig(**moe, ep=8, dp=4))


def test_vocabulary_padding_and_a_config_given_twice(tmp_path):
    """make_vocab_size_divisible_by pads as Megatron (to a multiple of it x tp; 50257 at tp 8 and
    128: 6400 rows a rank); a key at the top and under model: that disagree is refused (the
    model: one won silently)."""
    c = est.config_from_dict(dict(hidden=4096, layers=2, heads=32, vocab=50257, tp=8, make_vocab_size_divisible_by=128))
    assert est._vocab_rows(c) == 6400 and est._vocab_rows(est.replace(c, vocab_multiple=1)) == 6283
    (tmp_path / "c.yaml").write_text("tp: 8\nmodel: {hidden: 64, layers: 2, heads: 8, vocab: 100, tp: 1}\n")
    with pytest.raises(ValueError, match="'tp' is given at the top .8. and under model: .1., differently"):
        est.load_config(tmp_path / "c.yaml")
    (tmp_path / "c.yaml").write_text("tp: 2\nmodel: {hidden: 64, layers: 2, heads: 8, vocab: 100, tp: 2}\n")
    assert est.load_config(tmp_path / "c.yaml").tp == 2
    (tmp_path / "c.yaml").write_text("num_query_groups: null\nmodel: {hidden: 64, layers: 2, heads: 8, vocab: 100, "
                                     "num_query_groups: 4}\n")  # (null: unset, as an argument dump writes it)
    assert est.load_config(tmp_path / "c.yaml").kv_heads == 4


def test_pipeline_stages_hold_micro_batches_in_flight():
    e = est.estimate(_dense(pp=4, micro_batches=8))
    assert [s.in_flight for s in e.stages] == [4, 3, 2, 1]
    assert all(s.layers == 2 for s in e.stages)
    assert e.stages[0].activations > e.stages[1].activations
    assert sum(s.params for s in e.stages) == e.total_params


def test_parameter_count_matches_the_models():
    from npu_pool.workloads import make_config, param_count

    for flavour, shape, tp in (("gpt", None, 1), ("llama", None, 1), ("moe", None, 1), ("llama", "7b", 2),
                               ("moe", "7b", 4)):
        g = make_config(flavour, shape, tp=tp)
        c = est.ModelConfig(hidden=g.dim, layers=g.n_layers, heads=g.n_heads, vocab=g.vocab, ffn=g.ffn_dim,
                            kv_heads=g.kv_heads, tp=tp, experts=g.n_experts, top_k=g.top_k,
                            gated_mlp=g.mlp == "swiglu", bias=g.bias, norm=g.norm,
                            position="rope" if g.rope else "learned", max_positions=g.max_seq, seq=g.max_seq)
        assert est.estimate(c).stage.params == param_count(g), (flavour, shape, tp)


def test_config_files_and_errors(tmp_path):
    y = tmp_path / "m.yaml"
    y.write_text("model:\n  hidden_size: 512\n  num_layers: 4\n  num_attention_heads: 8\n  vocab_size: 1000\n"
                 "seq_length: 256\nmicro_batch_size: 2\nzero_stage: 1\ndp: 4\nrecompute_granularity: full\n")
    c = est.load_config(y)
    assert (c.hidden, c.layers, c.heads, c.vocab, c.seq, c.micro_batch, c.zero, c.dp, c.recompute) == \
        (512, 4, 8, 1000, 256, 2, 1, 4, "full")
    with pytest.raises(ValueError, match="unknown config key"):
        est.config_from_dict({"hidden": 8, "layers": 1, "heads": 1, "vocab": 2, "colour": 1})
    with pytest.raises(ValueError, match="lacks"):
        est.config_from_dict({"hidden": 8})
    with pytest.raises(ValueError, match="divisible"):
        est.estimate(_dense(tp=3))
    with pytest.raises(ValueError, match="zero"):
        est.estimate(_dense(zero=4))


def test_estimate_against_a_captured_run(captured):
    cfg = est.config_from_trace(captured.meta)
    assert cfg is not None and cfg.micro_batch == 2 and cfg.seq == 64
    rows = {r.figure: r for r in est.compare(est.estimate(cfg), breakdown.profile_trace(captured))}
    for fig in ("weights", "gradients", "optimizer states"):
        assert rows[fig].diff == 0, fig  # fp32 AdamW: exact
    assert 0.8 < rows["activations"].ratio < 1.25
    assert rows["temporaries"].estimated is None and rows["temporaries"].measured > 0


# -- reports -------------------------------------------------------------------------------------------------
def test_report_of_one_trace():
    t = toy_trace()
    a = analyze_trace(t, "toy", POLICIES)
    p = a.profile
    for f in a.policies:
        r = replay.run(t, f.policy)
        assert f.peak_reserved == r.peak_reserved_bytes and f.waste == f.peak_reserved - p.peak_live
        assert f.utilization == pytest.approx(p.peak_live / f.peak_reserved)
    from npu_pool.analysis.report import Analysis

    md = to_markdown(Analysis("toy", [a]))
    assert fmt_bytes(p.peak_live) in md and p.peak_phase.describe() in md
    assert all(f"| {pol} |" in md for pol in POLICIES) and "| layer |" in md and SITES[S_ACT] in md


def test_ranks_table_and_imbalance(tmp_path):
    d = tmp_path / "ranks"
    d.mkdir()
    for rank, act in enumerate((3 * MiB, 5 * MiB, 3 * MiB)):
        toy_trace(act=act).save(d / f"rank{rank}.npt")
    a = analyze_paths([str(d)], ["torch", "npu_pool"], show_progress=False)
    assert [t.name for t in a.traces] == ["rank0", "rank1", "rank2"] and a.ranks
    live = {r["figure"]: r for r in imbalance(a)}["peak_live"]
    peaks = [t.profile.peak_live for t in a.traces]
    assert live["max_rank"] == "rank1" and live["spread_bytes"] == max(peaks) - min(peaks)
    assert live["max_over_mean"] == pytest.approx(max(peaks) / (sum(peaks) / 3))
    md = to_markdown(a)
    assert "## Ranks" in md and "rank with the highest peak (rank1)" in md
    j = to_json(a)
    assert len(j["traces"]) == 3 and j["imbalance"]


def test_analyze_and_estimate_commands(tmp_path, capsys):
    src = tmp_path / "toy.npt"
    toy_trace().save(src)
    out = tmp_path / "r.json"
    assert main(["analyze", str(src), "--format", "json", "--out", str(out), "--policy", "torch,npu_pool",
                 "--no-progress"]) == 0
    j = json.loads(out.read_text())
    tr = j["traces"][0]
    assert tr["peak_live_bytes"] == live_profile(toy_trace()).peak_bytes
    assert [p["policy"] for p in tr["policies"]] == ["torch", "npu_pool"]
    assert tr["peak_phase"]["stage"] == "forward"
    assert main(["analyze", str(src), "--no-progress"]) == 0
    assert "# Memory analysis" in capsys.readouterr().out
    assert main(["estimate", "--hidden", "512", "--layers", "4", "--heads", "8", "--vocab", "1000", "--zero", "2",
                 "--dp", "4", "--format", "json"]) == 0
    e = json.loads(capsys.readouterr().out)
    assert e["gradients_bytes"] * 2 == e["weights_bytes"] and e["config"]["zero"] == 2  # (fp32 gradients of bf16 / 4)
    assert main(["estimate"]) == 2  # nothing to estimate: a one-line error, a mistake in the command line
    assert "give --config" in capsys.readouterr().err
    # a flag's bad value, or flags short of a model, are mistakes in the command line too (they exited 1)
    for argv, said in ((["--hidden", "-4096", "--layers", "2", "--heads", "2", "--vocab", "100"], "hidden must be"),
                       (["--hidden", "4096"], "config lacks layers, heads, vocab")):
        assert main(["estimate", *argv]) == 2
        assert said in capsys.readouterr().err


def test_estimate_command_against_a_capture(captured, tmp_path, capsys):
    src = tmp_path / "cap.npt"
    captured.save(src)
    assert main(["estimate", "--trace", str(src)]) == 0
    text = capsys.readouterr().out
    assert "## Estimate vs the trace" in text and "| weights |" in text
    assert main(["analyze", str(src), "--estimate", "--policy", "npu_pool", "--no-progress"]) == 0
    assert "Static estimate vs the trace" in capsys.readouterr().out


def test_analyze_estimate_takes_the_config_of_the_worst_of_two_same_named_captures(captured, tmp_path, capsys):
    """Same-named traces in two folders are told apart by folder (b/cap); --estimate used to look
    the worst one up by its original name and found none."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    small = Trace(meta=dict(captured.meta))
    for column in ("op", "cat", "site", "id", "size", "stream", "addr"):  # (same capture, fewer bytes)
        getattr(small, column).extend(getattr(captured, column))
    small.size = array.array("Q", (s // 2 for s in captured.size))
    small.save(tmp_path / "a" / "cap.npt")
    captured.save(tmp_path / "b" / "cap.npt")
    assert main(["analyze", str(tmp_path / "a" / "cap.npt"), str(tmp_path / "b" / "cap.npt"), "--estimate",
                 "--policy", "npu_pool", "--no-progress"]) == 0
    assert "Static estimate vs the trace" in capsys.readouterr().out


def test_estimate_without_an_optimizer_and_tensor_parallel_shapes(capsys):
    base = ["estimate", "--hidden", "512", "--layers", "2", "--heads", "8", "--format", "json"]
    assert main(base + ["--vocab", "1000", "--optimizer", "none"]) == 0
    e = json.loads(capsys.readouterr().out)
    assert e["optimizer_states_bytes"] == 0  # no optimizer: no states, and no fp32 master copy either
    assert main(base + ["--vocab", "3", "--tp", "8"]) == 0  # a vocabulary smaller than tp: padded, a row a rank
    e = json.loads(capsys.readouterr().out)
    assert main(base + ["--vocab", "8", "--tp", "8"]) == 0
    assert json.loads(capsys.readouterr().out)["weights_bytes"] == e["weights_bytes"]
    assert main(base + ["--vocab", "1000", "--ffn", "2", "--tp", "4"]) == 2  # (flags that do not go together: a usage error)
    assert "ffn=2 not divisible by tp=4" in capsys.readouterr().err


def test_a_policy_named_twice_is_refused(tmp_path, capsys):
    src = tmp_path / "toy.npt"
    toy_trace().save(src)
    assert main(["replay", str(src), "--policy", "torch,torch"]) == 2
    assert "names torch twice" in capsys.readouterr().err


def test_export_of_a_paused_tag_leaves_the_device_with_it(tmp_path):
    """npu_pool unmaps a paused tag's memory and keeps its tensors allocated; PyTorch's tools know
    no allocation off the device: the export frees them at the unmap and allocates them again at
    the map that brings them back, as the torch policy's export (explicit offload) shows them."""
    t = Trace(meta={"n_ids": 2})
    t.append(OP_REGION, id=0)
    t.append(OP_ALLOC, id=0, size=64 << 20)
    t.append(OP_REGION, id=-1)
    t.append(OP_PAUSE, id=0, cat=1)
    t.append(OP_ALLOC, id=1, size=64 << 20)
    t.append(OP_FREE, id=1, size=64 << 20)
    t.append(OP_RESUME, id=0)
    t.append(OP_FREE, id=0, size=64 << 20)
    t.validate()
    for policy in ("torch", "npu_pool"):
        out = tmp_path / f"{policy}.pickle"
        memviz.export([t], policy, str(out))
        snap = pickle.loads(out.read_bytes())
        live, mapped, peak = {}, [], 0
        for e in snap["device_traces"][0]:
            a, n = e["addr"], e["size"]
            if e["action"] in ("segment_map", "segment_alloc"):
                mapped.append((a, a + n))
            elif e["action"] in ("segment_unmap", "segment_free"):
                assert not any(a <= b < a + n for b in live), (policy, e)  # nothing allocated leaves the device
                mapped = [(lo, hi) for lo, hi in mapped if not (a <= lo and hi <= a + n)]
            elif e["action"] == "alloc":
                assert a not in live and any(lo <= a and a + n <= hi for lo, hi in mapped), (policy, e)
                live[a] = n
                peak = max(peak, sum(live.values()))
            elif e["action"] == "free_completed":
                assert live.pop(a) == n, (policy, e)
        assert peak == 64 << 20 and not live, policy  # the peak live bytes, as analyze says


# -- OOM snapshots ----------------------------------------------------------------------------------------------


# -- categories from recorded Python frames (imported snapshots) -------------------------------
def test_frame_kind_reads_the_innermost_frame_that_says():
    k = breakdown.frame_kind
    assert k("torch/nn/modules/linear.py:105:reset_parameters < model.py:10:__init__") == "setup"
    assert k("einops/_backends.py:291:einsum < model.py:39:forward < train.py:5:main") == "forward"
    assert k("torch/autograd/__init__.py:347:backward < torch/_tensor.py:648:backward") == "backward"
    assert k("torch/optim/adamw.py:500:_multi_tensor_adamw < torch/optim/adamw.py:230:step") == "optimizer"
    assert k("cs336_basics/optimizer.py:71:step < train.py:145:main") == "optimizer"
    assert k("train.py:144:main < train.py:249:<module>") is None and k("Linear:aten::linear") is None


def test_an_imported_trace_without_categories_is_classified_from_its_frames():
    sites = ["torch/nn/modules/linear.py:105:reset_parameters", "model.py:39:forward",
             "torch/autograd/__init__.py:347:backward", "torch/optim/adamw.py:230:step", "train.py:9:main"]
    t = Trace(meta={"origin": "imported", "sites": sites})
    plan = [(0, 4 * MiB, 0), (1, 2 * MiB, 1), (2, 1 * MiB, 1), ("free", 2), (3, 3 * MiB, 2), (4, 1 * MiB, 2),
            ("free", 4), ("free", 1), (5, 8 * MiB, 3), (6, 5 * MiB, 4)]
    sizes = {}
    for step in plan:
        if step[0] == "free":
            i = step[1]
            t.append(OP_FREE, id=i, size=sizes[i][0], site=sizes[i][1])
        else:
            i, size, site = step
            sizes[i] = (size, site)
            t.append(OP_ALLOC, id=i, size=size, site=site)
    p = breakdown.profile_trace(t)
    assert p.category_source == "frames"
    # weights 4, activation 2 (kept into backward), gradient 3, optimizer state 8, unknown 5; the
    # forward temporary (1 MiB) and the backward temporary (1 MiB) died in their stretch
    assert p.at_peak == {"weights": 4 * MiB, "gradients": 3 * MiB, "optimizer_states": 8 * MiB, "activations": 0,
                         "temporaries": 0, "other": 0, "unknown": 5 * MiB}
    assert p.group_max["activations"] == 2 * MiB and p.group_max["temporaries"] == 1 * MiB


def test_a_fake_captures_estimate_counts_its_position_table() -> None:
    """A fake capture builds the shape's position table (4096 rows for 7b, longer for a longer
    sequence); its estimate took one of seq rows: weights, gradients and optimizer states 1.4% off
    for a GPT 7b capture, where the docs say they match (a review, 2026-11-27)."""
    from npu_pool.capture import fake_capture

    for seq in (64, 5000):
        t = fake_capture("gpt", "7b", steps=1, batch=1, seq=seq, layers=1, progress=False)
        assert est.estimate(est.config_from_trace(t.meta)).total_params == t.meta["capture"]["param_count"], seq


@pytest.mark.parametrize("policy", ["npu_pool", "torch", "expandable", "planned"])
def test_a_segments_stream_is_the_one_its_map_events_name(policy, tmp_path) -> None:
    """memory_viz merges the ranges of one stream only: an npu_pool segment (one arena for every stream)
    took its first block's stream (7) where its map events name stream 0, and its blocks ran past their
    segment in 'Allocator State History' (a review, a helper). The pool's snapshot and an export under a
    policy both name, for each segment, the stream of the map or segment event at its first byte."""
    from npu_pool.snapshot import pool_snapshot

    MiB = 1 << 20
    with Pool(policy, capacity=512 * MiB) as pool:  # (planned without a plan: its fallback arena)
        for size, stream in [(3 * MiB, 7), (5 * MiB, 0), (30 * MiB, 7)]:
            pool.malloc(size, stream=stream)
        snaps = [pool_snapshot({0: pool})]
    t = Trace(meta={"n_ids": 3})
    for i, (size, stream) in enumerate([(3 * MiB, 7), (5 * MiB, 0), (30 * MiB, 7)]):
        t.append(OP_ALLOC, id=i, size=size, stream=stream)
    if policy != "planned":
        snaps.append(memviz.snapshot_of([t], policy))
    for snap in snaps:
        starts = {e["addr"]: e["stream"] for e in snap["device_traces"][0]
                  if e["action"] in ("segment_map", "segment_alloc")}
        assert snap["segments"] and all(s["stream"] == starts.get(s["address"], s["stream"]) for s in snap["segments"])
        assert any(s["address"] in starts for s in snap["segments"])


def test_frameless_allocations_after_the_loss_are_the_backwards():
    """The backward's allocations carry no Python frame (autograd's engine); between the forward and them a
    training step computes its loss in code of no stage (cross_entropy in the user's file). That code reset
    the chain, and an imported training snapshot showed no gradient at all: cs336-medium-ctx128-train 96.8%
    unknown where only the tensors live before its recording are (a review of the reports, a helper)."""
    sites = ["model.py:39:forward", "nn_utils.py:12:cross_entropy", "torch/optim/adamw.py:230:step"]
    t = Trace(meta={"origin": "imported", "sites": sites})
    t.append(OP_ALLOC, id=0, size=2 * MiB, site=0)   # an activation, kept into the backward
    t.append(OP_ALLOC, id=1, size=1 * MiB, site=1)   # the loss
    t.append(OP_ALLOC, id=2, size=3 * MiB, site=-1)  # a gradient: no frame
    t.append(OP_FREE, id=0, size=2 * MiB, site=0)
    t.append(OP_FREE, id=1, size=1 * MiB, site=1)
    t.append(OP_ALLOC, id=3, size=4 * MiB, site=2)   # an optimizer state
    p = breakdown.profile_trace(t)
    assert p.category_source == "frames"
    assert p.at_peak["gradients"] == 3 * MiB and p.at_peak["unknown"] == 0


def test_an_exported_capture_keeps_its_sites_when_read_back(tmp_path) -> None:
    """A capture's sites are op paths (``Linear:aten::linear>aten::mm``), exported as frames of the file
    SITE_FILE; the importer kept only frames of .py files, and the export analysed or imported again had
    one site, '(unknown site)', for every allocation (a review of the reports, a helper)."""
    sites = ["Linear:aten::linear>aten::mm", "RMSNorm:aten::mul", "model.py:39:forward < train.py:9:main"]
    t = Trace(meta={"origin": "capture", "sites": sites, "n_ids": 3})
    for i in range(3):
        t.append(OP_ALLOC, id=i, size=(i + 1) * MiB, site=i)
    path = memviz.write_snapshot(memviz.snapshot_of([t], "npu_pool"), tmp_path / "x.pickle")
    back, = load_snapshot(path)
    got = [back.meta["sites"][s] for s in back.site if s >= 0]
    assert got[:2] == sites[:2] and got[2].endswith("model.py:39:forward < train.py:9:main")


def test_a_megatron_config_reads_its_own_spellings_and_sets_training_settings_aside(tmp_path) -> None:
    """Megatron's config keys (bf16, normalization, position_embedding_type, use_distributed_optimizer,
    disable_bias_linear, the dropouts) were refused one at a time as unknown, and its training-only
    settings (global_batch_size, recompute_method, ...) too (a review of the estimate, a helper): read
    as this model's fields, the latter set aside and named."""
    d = {"num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "padded_vocab_size": 32000,
         "bf16": True, "normalization": "RMSNorm", "position_embedding_type": "rope", "use_distributed_optimizer": True,
         "disable_bias_linear": True, "attention_dropout": 0.0, "hidden_dropout": 0.0, "global_batch_size": 1024,
         "recompute_method": "uniform", "recompute_num_layers": 1}
    ignored: list[str] = []
    c = est.config_from_dict(d, ignored)
    assert (c.dtype, c.norm, c.position, c.zero, c.bias, c.dropout) == ("bf16", "rmsnorm", "rope", 1, False, False)
    assert ignored == ["global_batch_size", "recompute_method", "recompute_num_layers"]
    assert est.config_from_dict(dict(d, position_embedding_type="learned_absolute", hidden_dropout=0.1,
                                     attention_dropout=0.1)).position == "learned"
    with pytest.raises(ValueError, match="both give dropout, differently"):
        est.config_from_dict(dict(d, hidden_dropout=0.1))
