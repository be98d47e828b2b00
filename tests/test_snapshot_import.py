"""Importing PyTorch memory snapshots: window rebuild, hostile input, the real traces."""
from __future__ import annotations

import collections
import os
import pickle
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npu_pool.cli import main
from npu_pool.trace import Trace, TraceError
from npu_pool.trace.format import (OP_ALLOC, OP_EMPTY_CACHE, OP_FREE, OP_INIT_ALLOC, OP_INIT_SEGMENT,
                                   OP_SEG_FREE, OP_SEG_HINT, POOL_LARGE, POOL_SMALL)
from npu_pool.trace.snapshot import load_snapshot, snapshot_to_traces
from npu_pool.trace.stats import initial_live_bytes, live_profile, op_counts

from conftest import unavailable

_SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"
M = 1 << 20

_C_FRAME = {"filename": "??", "line": 0, "name": "c10::alloc"}
_USER = [_C_FRAME,
         {"filename": "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"},
         {"filename": "/home/u/proj/model.py", "line": 10, "name": "forward"},
         {"filename": "/usr/lib/python3.11/runpy.py", "line": 86, "name": "_run_code"},
         {"filename": "/home/u/proj/train.py", "line": 20, "name": "main"}]
_BLOCK_FRAMES = [{"filename": "/home/u/proj/setup.py", "line": 5, "name": "build"}]
_TORCH_ONLY = [{"filename": "/x/site-packages/torch/optim/adamw.py", "line": 7, "name": "step"}]


def _ev(action: str, addr: int = 0, size: int = 0, frames: list | None = None, stream: int = 0) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": stream, "frames": frames or [], "time_us": 1}


def _block(addr: int, size: int, state: str, requested: int | None = None, frames: list | None = None) -> dict:
    return {"address": addr, "size": size, "requested_size": size if requested is None else requested,
            "state": state, "frames": frames or []}


def _windowed() -> dict:
    """A window that starts mid-run; comments give what the importer must rebuild."""
    events = [
        _ev("free_completed", 400 * M, 1 * M),                  # 0 pre-window alloc, its segment freed later
        _ev("free_requested", 112 * M, 3 * M),                  # 1 pre-window alloc
        _ev("free_completed", 112 * M, 3 * M),                  # 2
        _ev("alloc", 104 * M, 8 * M, _USER),                    # 3 live at the end
        _ev("segment_alloc", 300 * M, 10 * M),                  # 4 not an initial segment
        _ev("alloc", 300 * M, 1 * M, _TORCH_ONLY),              # 5
        _ev("free_requested", 300 * M, 1 * M),                  # 6
        _ev("free_completed", 300 * M, 1 * M),                  # 7
        _ev("snapshot"),                                        # 8 ignored
        _ev("segment_free", 400 * M, 2 * M),                    # 9  run 1: one empty_cache
        _ev("segment_free", 500 * M, 30 * M),                   # 10
        _ev("alloc", 116 * M, 4 * M, _USER),                    # 11
        _ev("free_requested", 116 * M, 4 * M),                  # 12 never completed: the free point
        _ev("segment_alloc", 700 * M, 2 * M),                   # 13 made and released in the window
        _ev("segment_free", 700 * M, 2 * M),                    # 14 run 2
    ]
    segments = [
        {"device": 0, "address": 100 * M, "total_size": 20 * M, "stream": 0, "segment_type": "large",
         "is_expandable": False, "blocks": [
             _block(100 * M, 4 * M, "active_allocated", 4 * M - 100, _BLOCK_FRAMES),  # pre-window, never touched
             _block(104 * M, 8 * M, "active_allocated"),
             _block(112 * M, 4 * M, "inactive"),
             _block(116 * M, 4 * M, "active_pending_free")]},
        {"device": 0, "address": 200 * M, "total_size": 2 * M, "stream": 0, "segment_type": "small",
         "blocks": [_block(200 * M, 2 * M, "inactive")]},
        {"device": 0, "address": 300 * M, "total_size": 10 * M, "stream": 0, "segment_type": "large",
         "blocks": [_block(300 * M, 10 * M, "inactive")]},
    ]
    return {"segments": segments, "device_traces": [events]}


def _rows(t: Trace) -> list[tuple]:
    return [(e.op, e.id, e.addr // M, e.size) for e in t.events()]


def test_windowed_rebuild_and_order() -> None:
    (t,) = snapshot_to_traces(_windowed(), "win.pickle")
    t.validate()
    assert _rows(t) == [
        (OP_INIT_SEGMENT, -1, 100, 20 * M), (OP_INIT_SEGMENT, -1, 200, 2 * M),
        (OP_INIT_SEGMENT, -1, 400, 2 * M), (OP_INIT_SEGMENT, -1, 500, 30 * M),
        (OP_INIT_ALLOC, 0, 100, 4 * M - 100), (OP_INIT_ALLOC, 1, 112, 3 * M), (OP_INIT_ALLOC, 2, 400, 1 * M),
        (OP_FREE, 2, 400, 1 * M), (OP_FREE, 1, 112, 3 * M),
        (OP_ALLOC, 3, 104, 8 * M),
        (OP_SEG_HINT, -1, 300, 10 * M),
        (OP_ALLOC, 4, 300, 1 * M), (OP_FREE, 4, 300, 1 * M),
        (OP_EMPTY_CACHE, -1, 0, 0), (OP_SEG_FREE, -1, 400, 2 * M), (OP_SEG_FREE, -1, 500, 30 * M),
        (OP_ALLOC, 5, 116, 4 * M), (OP_FREE, 5, 116, 4 * M),
        (OP_SEG_HINT, -1, 700, 2 * M), (OP_EMPTY_CACHE, -1, 0, 0), (OP_SEG_FREE, -1, 700, 2 * M),
    ]
    # pools: end-state segment_type where known, else the 2 MiB rule
    assert list(t.cat[:4]) == [POOL_LARGE, POOL_SMALL, POOL_SMALL, POOL_LARGE]
    assert t.meta["n_ids"] == 6
    assert t.meta["device"] == 0 and t.meta["origin"] == "win.pickle"
    assert t.meta["ignored_events"] == {"free_requested": 2, "snapshot": 1}
    assert t.meta["warnings"] == []
    assert t.meta["recorded"] == {"initial_reserved_bytes": 54 * M, "peak_reserved_bytes": 64 * M,
                                  "segment_allocs": 2}
    assert t.meta["expandable_segments"] is False and "allocator_settings" not in t.meta
    assert initial_live_bytes(t) == 8 * M - 100
    assert live_profile(t) == (4 * M - 100 + 8 * M + 4 * M, 16)  # init block at 100 MiB + 104 + 116


def test_sites() -> None:
    (t,) = snapshot_to_traces(_windowed(), "win.pickle")
    sites = t.meta["sites"]
    by_addr = {(e.op, e.addr // M): e.site for e in t.events() if e.op in (OP_ALLOC, OP_INIT_ALLOC)}
    # user frames only, innermost first, torch's and the stdlib's own frames skipped
    assert sites[by_addr[OP_ALLOC, 104]] == "proj/model.py:10:forward < proj/train.py:20:main"
    assert by_addr[OP_ALLOC, 116] == by_addr[OP_ALLOC, 104]
    assert sites[by_addr[OP_ALLOC, 300]] == "optim/adamw.py:7:step"  # torch frames when nothing else
    assert sites[by_addr[OP_INIT_ALLOC, 100]] == "proj/setup.py:5:build"  # from the end-state block
    assert by_addr[OP_INIT_ALLOC, 112] == -1  # a free's frames are not an allocation site
    assert len(sites) == len(set(sites)) == 3


def test_site_keeps_four_innermost_user_frames() -> None:
    frames = [{"filename": f"/p/m{i}.py", "line": i, "name": f"f{i}"} for i in range(6)]
    snap = {"device_traces": [[_ev("alloc", 0, 8, frames), _ev("alloc", 64, 8, [_C_FRAME])]]}
    (t,) = snapshot_to_traces(snap, "s")
    assert t.meta["sites"] == [" < ".join(f"p/m{i}.py:{i}:f{i}" for i in range(4))]
    assert list(t.site) == [0, -1]


def test_anomalies_become_warnings() -> None:
    snap = _windowed()
    snap["device_traces"][0] += [_ev("free_completed", 900 * M, 1 * M),   # outside every segment
                                 _ev("free_completed", 900 * M, 1 * M),   # freed twice
                                 _ev("weird_action", 1, 1)]
    (t,) = snapshot_to_traces(snap, "win.pickle")
    t.validate()
    text = "\n".join(t.meta["warnings"])
    assert "lies in no initial segment" in text
    assert "already freed" in text
    assert "unknown action 'weird_action'" in text
    assert t.meta["ignored_events"]["weird_action"] == 1


def test_per_device_and_settings() -> None:
    dev1 = [_ev("alloc", 8 * M, 100), _ev("free_completed", 8 * M, 100), _ev("free_completed", 10 * M, 50)]
    snap = {"device_traces": [[], dev1],
            "segments": [{"device": 0, "address": 0, "total_size": 2 * M, "stream": 0, "blocks": []},
                         {"device": 1, "address": 8 * M, "total_size": 4 * M, "stream": 0,
                          "is_expandable": True, "blocks": []}],
            "allocator_settings": {"expandable_segments": False}}
    (t,) = snapshot_to_traces(snap, "multi")
    assert t.meta["device"] == 1
    assert t.meta["expandable_segments"] is True  # a segment says so, whatever the settings
    assert t.meta["allocator_settings"] == {"expandable_segments": False}
    snap["allocator_settings"] = {"expandable_segments": True, "odd": (1, b"x")}
    snap["segments"][1]["is_expandable"] = False
    (t,) = snapshot_to_traces(snap, "multi")
    assert t.meta["expandable_segments"] is True  # from the settings
    assert t.meta["allocator_settings"]["odd"] == [1, "b'x'"]  # kept JSON-serialisable
    assert [(e.op, e.addr // M) for e in t.events() if e.op == OP_INIT_SEGMENT] == [(OP_INIT_SEGMENT, 8)]
    assert t.meta["warnings"] == []


# -- hostile and broken input ----------------------------------------------------------------


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_refuses_global_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [[]], "x": _Evil(marker)}))
    with pytest.raises(TraceError, match=r"evil\.pickle.*global .*system"):
        load_snapshot(path)
    assert not marker.exists()


def test_refuses_ordered_dict(tmp_path: Path) -> None:
    path = tmp_path / "od.pickle"
    path.write_bytes(pickle.dumps(collections.OrderedDict(device_traces=[[]])))
    with pytest.raises(TraceError, match=r"od\.pickle.*collections\.OrderedDict"):
        load_snapshot(path)


@pytest.mark.parametrize("keep", [0, 1, 10, -1, -5])
def test_truncated_pickle(tmp_path: Path, keep: int) -> None:
    data = pickle.dumps(_windowed())
    path = tmp_path / "cut.pickle"
    path.write_bytes(data[:keep])
    with pytest.raises(TraceError, match=r"cut\.pickle.*(corrupt|truncated)"):
        load_snapshot(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="nope.pickle: cannot read"):
        load_snapshot(tmp_path / "nope.pickle")


def test_the_pools_own_snapshots_carry_device_streams_and_older_ones_still_load(tmp_path: Path) -> None:
    """npu_pool's snapshot wrote the core's tags of free memory as streams (a segment kept for
    several streams after a record_stream; a failed resume's oom entry: -2^63 + 1 and -2^63), which
    no device stream has and the importer came to refuse (a helper's review): written as stream 0,
    and files written so before read with stream 0."""
    from npu_pool import Pool
    from npu_pool.snapshot import pool_snapshot
    from npu_pool.vocab import STREAM_TAGS

    M = 1 << 20
    with Pool("npu_pool", capacity=1 << 30) as p:
        a, b = p.malloc(3 * M, stream=7), p.malloc(M, stream=7)
        p.record_stream(a, 9)
        p.free(a)  # its memory now waits for both streams: tagged "several"
        snap = pool_snapshot({0: p})
        p.free(b)
    streams = [s["stream"] for s in snap["segments"]] + [e["stream"] for e in snap["device_traces"][0]]
    assert not set(streams) & set(STREAM_TAGS)
    maps = {e["addr"]: e["stream"] for e in snap["device_traces"][0] if e["action"] == "segment_map"}
    assert [s["stream"] for s in snap["segments"]] == [maps[snap["segments"][0]["address"]]] == [0]  # (the arena's)
    path = tmp_path / "own.pickle"
    path.write_bytes(pickle.dumps(snap))
    assert load_snapshot(path)
    older = {"device_traces": [[_ev("alloc", 4096, 512, stream=-(1 << 63)), _ev("oom", 0, M, stream=1 - (1 << 63))]],
             "segments": [{"address": 0, "total_size": 2 * M, "stream": -(1 << 63), "blocks": []}]}
    (t,) = snapshot_to_traces(older, "older.pickle")
    assert set(t.stream) == {0}


@pytest.mark.parametrize("obj, msg", [
    ([1, 2], "top level is list"),
    ({"segments": []}, "recorded without torch.cuda.memory._record_memory_history"),
    ({"segments": [], "device_traces": [[], []]}, "_record_memory_history"),
    ({"foo": 1}, "no 'device_traces' key"),
    ({"device_traces": []}, "snapshot has no device_traces events"),  # the key is there: not "no key"
    ({"device_traces": [[]], "segments": []}, "snapshot has no device_traces events"),  # no segments either
    ({"device_traces": [[]], "segments": [{"address": 1}]}, "snapshot has segments but no device_traces events"),
    ({"device_traces": "abc"}, "device_traces should be a list"),
    ({"device_traces": [{"a": 1}]}, r"device_traces\[0\] should be a list"),
    ({"device_traces": [0]}, r"device_traces\[0\] should be a list"),
    ({"device_traces": [[1]]}, r"device_traces\[0\]\[0\] should be a dict"),
    ({"device_traces": [[{"action": 3}]]}, r"action should be a string"),
    ({"device_traces": [[{**_ev("alloc"), "size": "big"}]]}, r"\[0\]\[0\]\.size should be a non-negative"),
    ({"device_traces": [[{**_ev("alloc"), "addr": -5}]]}, r"addr should be a non-negative"),
    ({"device_traces": [[{**_ev("alloc"), "size": True}]]}, r"size should be a non-negative 64-bit integer, got True"),
    ({"device_traces": [[{"action": "alloc", "size": 1}]]}, r"has no 'addr'"),
    ({"device_traces": [[{**_ev("alloc"), "frames": "x"}]]}, r"frames should be a list"),
    ({"device_traces": [[{**_ev("alloc"), "frames": [1]}]]}, r"frames should hold dicts"),
    ({"device_traces": [[_ev("alloc")]], "segments": {}}, "segments should be a list"),
    ({"device_traces": [[_ev("alloc")]], "segments": [{"address": 1}]}, r"segments\[0\] has no 'total_size'"),
    ({"device_traces": [[_ev("alloc")]], "segments": [{"address": 1, "total_size": 2, "blocks": [{}]}]},
     r"blocks\[0\]\.state should be a string"),
    ({"device_traces": [[_ev("alloc")]], "allocator_settings": [1]}, "allocator_settings should be a dict"),
])
def test_foreign_input(obj: object, msg: str) -> None:
    with pytest.raises(TraceError, match=msg) as info:
        snapshot_to_traces(obj, "foreign.pickle")
    assert str(info.value).startswith("foreign.pickle: ")


# -- the command -----------------------------------------------------------------------------


def test_cli_import(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = tmp_path / "win.pickle"
    src.write_bytes(pickle.dumps(_windowed()))
    assert main(["import", str(src), "--out", str(tmp_path / "out")]) == 0
    t = Trace.load(tmp_path / "out" / "win.dev0.npt")
    t.validate()
    assert op_counts(t)["alloc"] == 3
    line = capsys.readouterr().out.strip()
    assert line.startswith("win.dev0.npt: 21 events, 6 allocations (3 of them live when the recording began), "
                           "initial live ") and "peak live" in line


def test_cli_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(b"\x80\x04garbage")
    assert main(["import", str(bad), "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "npu-pool import: error:" in err and "bad.pickle" in err


# -- the real traces (skipped without ../shared/traces) -------------------------------------------


def _readme_rows() -> list[dict[str, str]]:
    """The README's table as dicts keyed by its header."""
    lines = [ln for ln in (_SHARED / "README.md").read_text().splitlines() if ln.startswith("|")]
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
    header = cells[0]
    return [dict(zip(header, row)) for row in cells[2:] if row[0].endswith(".pickle")]


_REAL = _readme_rows() if (_SHARED / "README.md").is_file() else []
@pytest.mark.parametrize("row", _REAL or [None], ids=lambda r: r["file"] if r else "absent")
def test_real_trace(row: dict[str, str] | None) -> None:
    if row is None:  # (a skip on a user's clone; in CI, where ../shared is, a failure)
        unavailable(f"{_SHARED}/README.md is absent")
    traces = load_snapshot(_SHARED / row["file"])
    assert len(traces) == 1
    (t,) = traces
    t.validate()
    assert t.meta["warnings"] == []
    assert op_counts(t)["alloc"] == int(row["allocs"])
    # README values are rounded to 0.01 GiB
    gib = float(1 << 30)
    assert live_profile(t).peak_bytes / gib == pytest.approx(float(row["peak live GiB"]), abs=0.01)
    assert t.meta["recorded"]["peak_reserved_bytes"] / gib == pytest.approx(
        float(row["recorded reserved GiB"]), abs=0.01)
    # every initial allocation inside an initial segment, ids dense
    assert t.n_ids == sum(1 for op in t.op if op in (OP_ALLOC, OP_INIT_ALLOC))


# ---- every action PyTorch's TraceEntry has ---------------------------------------------------------

def _timed(action: str, t: int, addr: int = 0, size: int = 0, **extra: object) -> dict:
    e = {"action": action, "addr": addr, "size": size, "stream": 0, "frames": [], "time_us": t}
    e.update(extra)
    return e


def _oom_snapshot() -> dict:
    """What torch writes when a request fails with history on (OOM_SNAPSHOT_ENABLE / an OOM observer):
    expandable segments mapped and unmapped, a snapshot marker, an oom entry without an address."""
    events = [
        _timed("segment_map", 1, 100 * M, 20 * M),
        _timed("alloc", 2, 100 * M, 12 * M),
        _timed("alloc", 3, 112 * M, 6 * M),
        _timed("free_requested", 4, 112 * M, 6 * M),
        _timed("free_completed", 5, 112 * M, 6 * M),
        _timed("snapshot", 6),
        _timed("segment_unmap", 7, 112 * M, 8 * M),
        _timed("segment_alloc", 8, 200 * M, 2 * M),
        _timed("alloc", 9, 200 * M, 1000),
        {"action": "oom", "size": 40 * M, "stream": 0, "device_free": 10 * M, "frames": [], "time_us": 10},
    ]
    segments = [{"device": 0, "address": 100 * M, "total_size": 12 * M, "stream": 0, "segment_type": "large",
                 "is_expandable": True, "blocks": [_block(100 * M, 12 * M, "active_allocated")]},
                {"device": 0, "address": 200 * M, "total_size": 2 * M, "stream": 0, "segment_type": "small",
                 "blocks": [_block(200 * M, 1024, "active_allocated", 1000), _block(200 * M + 1024, 2 * M - 1024,
                                                                                    "inactive")]}]
    return {"segments": segments, "device_traces": [[], events, []],  # one trace per device, some empty
            "external_annotations": [
                {"device": 1, "name": "ProfilerStep#4", "stage": "START", "time_us": 0},
                {"device": 1, "name": "Optimizer.step#AdamW.step", "stage": "START", "time_us": 3},
                {"device": 1, "name": "Optimizer.step#AdamW.step", "stage": "END", "time_us": 5},
                {"device": 1, "name": "an op of the user's", "stage": "START", "time_us": 5},
                {"device": 1, "name": "ProfilerStep#4", "stage": "END", "time_us": 100}],
            "allocator_settings": {"expandable_segments": True}}


def test_every_trace_entry_action_imports(tmp_path: Path) -> None:
    snap = _oom_snapshot()
    for s in snap["segments"]:
        s["device"] = 1
    (t,) = snapshot_to_traces(snap, "oom.pickle")
    t.validate()
    assert t.meta["device"] == 1 and t.meta["expandable_segments"] is True
    from npu_pool.trace.format import MARK_ITER_BEGIN, MARK_ITER_END, MARK_OPTIMIZER_BEGIN, MARK_OPTIMIZER_END, OP_MARK, OP_OOM

    marks = [(e.cat, e.id) for e in t.events() if e.op == OP_MARK]
    assert marks == [(MARK_ITER_BEGIN, 4), (MARK_OPTIMIZER_BEGIN, -1), (MARK_OPTIMIZER_END, -1), (MARK_ITER_END, 4)]
    ooms = [e for e in t.events() if e.op == OP_OOM]
    assert [(e.size, e.addr) for e in ooms] == [(40 * M, 0)]
    (o,) = t.meta["ooms"]
    assert o["size"] == 40 * M and o["device_free"] == 10 * M and t.op[o["event"]] == OP_OOM
    assert t.meta["ignored_events"] == {"snapshot": 1, "free_requested": 1}  # the completed free counts
    counts = op_counts(t)
    assert counts["seg_hint"] == 2 and counts["seg_free"] == 1 and counts["oom"] == 1
    from npu_pool import replay

    r = replay.run(t, "npu_pool", probe_ooms=True)
    assert r.ok and r.recorded_ooms == 1 and r.ooms_served == 1  # 1 TiB: anything fits
    r = replay.run(t, "npu_pool")  # (passed over, as nobody served it)
    assert r.ok and r.recorded_ooms == 1 and r.ooms_served == 0
    assert replay.recorded_capacity(t) == 20 * M + 2 * M - 8 * M + 10 * M  # what it had mapped then, plus the free bytes
    assert not any(e.op == OP_INIT_SEGMENT for e in t.events())  # nothing was mapped before the window
    path = tmp_path / "oom.pickle"
    path.write_bytes(pickle.dumps(_oom_snapshot()))
    assert main(["replay", str(path), "--no-min-capacity"]) == 0


def test_recorded_oom_shows_in_the_report(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "oom.pickle"
    path.write_bytes(pickle.dumps(_oom_snapshot()))
    assert main(["analyze", str(path), "--policy", "torch,npu_pool"]) == 0
    out = capsys.readouterr().out
    assert "Out of memory in the recorded run" in out and "40.00 MiB with 10.00 MiB free on the device" in out
    assert "each policy would have served: torch" in out
    import json

    assert main(["analyze", str(path), "--policy", "npu_pool", "--format", "json", "--out", str(tmp_path / "r.json")]) == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["traces"][0]["recorded_ooms"]["sizes"] == [40 * M]


def test_an_empty_recording_says_how_to_record(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="without torch.cuda.memory._record_memory_history"):
        snapshot_to_traces({"segments": [], "device_traces": [[], []]}, "empty")


def _ranges_brute(ops: list[tuple[str, int, int]]) -> list[tuple[dict[int, int], bool | None]]:
    """What undoing (un)maps does to disjoint ranges, by scanning them all: the reference."""
    segs: dict[int, int] = {}
    states = []
    for op, addr, size in ops:
        lo, hi, whole = addr, addr + size, None
        if op == "add":
            for a in [a for a, s in segs.items() if a <= hi and a + s >= lo]:
                s = segs.pop(a)
                lo, hi = min(lo, a), max(hi, a + s)
            segs[lo] = hi - lo
        else:
            covered = 0
            for a in [a for a, s in segs.items() if a < hi and a + s > lo]:
                s = segs.pop(a)
                covered += min(a + s, hi) - max(a, lo)
                if a < lo:
                    segs[a] = lo - a
                if a + s > hi:
                    segs[hi] = a + s - hi
            whole = covered == size
        states.append((dict(segs), whole))
    return states


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "remove"]), st.integers(0, 60), st.integers(1, 16)), max_size=40))
def test_the_segment_map_merges_and_splits_as_a_scan_would(ops: list[tuple[str, int, int]]) -> None:
    from npu_pool.trace.segment_map import SegmentMap

    m = SegmentMap({x for _, a, s in ops for x in (a, a + s)})
    for (op, addr, size), (want, whole) in zip(ops, _ranges_brute(ops)):
        got = m.add_range(addr, size, 0) if op == "add" else m.remove_range(addr, size)
        assert got == whole and {a: v[0] for a, v in m.segs.items()} == want


def test_a_snapshot_of_many_segment_events_imports(tmp_path: Path) -> None:
    """A snapshot of 100,000 unmaps (3 MB) imports: each event's neighbours were found by scanning
    every range (40,000 took 35 s, this would take minutes); a sorted insert per event was
    quadratic too (200,000: 4 s of memmove)."""
    n = 100_000
    events = [_ev("alloc", 0x1000, M)] + [_ev("segment_unmap", (i + 1) * 4 * M, 2 * M) for i in range(n)]
    path = tmp_path / "unmaps.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [events]}, protocol=4))
    (t,) = load_snapshot(path)
    t.validate()
    assert op_counts(t)["init_segment"] == n and t.meta["recorded"]["initial_reserved_bytes"] == n * 2 * M


def test_a_segment_of_no_bytes_is_left_out_not_a_crash() -> None:
    """Two end-state segments at one address, the first of 0 bytes, then an unmap: the map counted
    the address twice and the next lookup raised KeyError (a review of this session's change)."""
    seg = lambda a, s: {"device": 0, "address": a, "total_size": s, "stream": 0,  # noqa: E731
                        "segment_type": "large", "blocks": []}
    snap = {"segments": [seg(100 * M, 0), seg(100 * M, 4 * M)],
            "device_traces": [[_ev("alloc", 300 * M, M), _ev("segment_free", 100 * M, 4 * M),
                               _ev("segment_alloc", 100 * M, 4 * M), _ev("segment_unmap", 104 * M, 2 * M)]]}
    (t,) = snapshot_to_traces(snap, "zero.pickle")
    t.validate()
    assert any("(+0 bytes) holds no bytes: left out" in w for w in t.meta["warnings"]), t.meta["warnings"]


def test_overlapping_segments_are_left_out_with_a_warning() -> None:
    snap = _windowed()
    snap["segments"].append({"device": 0, "address": 110 * M, "total_size": 4 * M, "stream": 0,
                             "segment_type": "large", "blocks": []})  # inside the first one
    (t,) = snapshot_to_traces(snap, "win.pickle")
    t.validate()
    assert any("the segment at 0x6e00000 (+4194304 bytes) overlaps the one at 0x6400000: left out" in w
               for w in t.meta["warnings"]), t.meta["warnings"]
    assert [e.addr // M for e in t.events() if e.op == OP_INIT_SEGMENT] == [100, 200, 400, 500]


def test_an_own_marker_whose_argument_no_trace_holds_names_no_phase() -> None:
    """npu_pool::<marker>::<arg> ranges are read back as that very marker; an argument past 64 bits
    raised OverflowError (a traceback for a hostile file): such a name names no phase."""
    events = [_timed("alloc", 1, 100 * M, 1000), _timed("alloc", 3, 200 * M, 1000)]
    snap = {"segments": [], "device_traces": [events], "external_annotations": [
        {"device": 0, "name": "npu_pool::layer_enter::99999999999999999999999", "stage": "START", "time_us": 0},
        {"device": 0, "name": "npu_pool::layer_enter::5", "stage": "START", "time_us": 2}]}
    (t,) = snapshot_to_traces(snap, "marks.pickle")
    t.validate()
    from npu_pool.trace.format import MARK_LAYER_ENTER, OP_MARK

    assert [(e.cat, e.id) for e in t.events() if e.op == OP_MARK] == [(MARK_LAYER_ENTER, 5)]
