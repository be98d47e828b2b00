"""Replay: the C loop equals per-call allocation, minimum capacity, fidelity, the CLI."""
from __future__ import annotations

import array
import json
import random

import pytest

from npu_pool import Pool, replay
from npu_pool.cli import main
from npu_pool.trace.format import (MARK_FORWARD_BEGIN, MARK_ITER_BEGIN, OP_ALLOC, OP_EMPTY_CACHE, OP_FREE,
                                   OP_INIT_ALLOC, OP_MARK, Trace, device_type)

MiB = 1 << 20
POLICIES = ["torch", "npu_pool", "expandable"]


def synthetic(seed: int, n: int = 600) -> Trace:
    """A windowed trace: initial live allocations, then random allocs/frees, markers, a cache release."""
    rng = random.Random(seed)
    t = Trace(meta={"origin": "synthetic"})
    live: list[tuple[int, int]] = []
    next_id = 0
    for _ in range(5):
        size = rng.randint(1, 8 * MiB)
        t.append(OP_INIT_ALLOC, id=next_id, size=size, addr=0)
        live.append((next_id, size))
        next_id += 1
    for i in range(n):
        r = rng.random()
        if r < 0.02:
            t.append(OP_MARK, cat=MARK_FORWARD_BEGIN)
        elif r < 0.03:
            t.append(OP_EMPTY_CACHE)
        elif live and r < 0.5:
            id_, size = live.pop(rng.randrange(len(live)))
            t.append(OP_FREE, id=id_, size=size)
        else:
            size = rng.choice([rng.randint(1, 4096), rng.randint(1, 2 * MiB), rng.randint(2 * MiB, 40 * MiB)])
            t.append(OP_ALLOC, id=next_id, size=size, site=rng.randint(0, 9), stream=rng.choice([0, 0, 7]))
            live.append((next_id, size))
            next_id += 1
    t.meta["n_ids"] = next_id
    t.meta["sites"] = [f"model.py:{10 + k}:layer{k}" for k in range(10)]
    t.validate()
    return t


def reference(trace: Trace, policy: str, use_sites: bool) -> tuple[list[int], int]:
    """The same trace served one Python call at a time."""
    placed = [0] * len(trace)
    ptrs: dict[int, int] = {}
    with Pool(policy, capacity=replay.UNLIMITED, rules=device_type(trace)) as pool:  # the rules replay applies
        for i, e in enumerate(trace.events()):
            if e.op in (OP_ALLOC, OP_INIT_ALLOC):
                life = "long" if e.op == OP_INIT_ALLOC else "auto"
                site = e.site if use_sites else -1
                ptrs[e.id] = placed[i] = pool.malloc(e.size, stream=e.stream, lifetime=life, site=site)
            elif e.op == OP_FREE:
                pool.free(ptrs.pop(e.id))
            elif e.op == OP_MARK:
                pool.mark(e.cat, e.id)
            elif e.op == OP_EMPTY_CACHE:
                pool.empty_cache()
        return placed, pool.stats()["total"]["reserved"]["peak"]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("hints", ["markers", "sites"])
def test_replay_equals_per_call_reference(policy, seed, hints):
    trace = synthetic(seed)
    placed = array.array("Q", bytes(8 * len(trace)))
    result = replay.run(trace, policy, placed=placed, hints=hints)
    want_placed, want_peak = reference(trace, policy, use_sites=hints == "sites")
    assert result.ok
    assert list(placed) == want_placed
    assert result.peak_reserved_bytes == want_peak
    assert result.ops == sum(1 for op in trace.op if op in (OP_ALLOC, OP_INIT_ALLOC, OP_FREE))


@pytest.mark.parametrize("policy", POLICIES)
def test_min_capacity_is_the_edge(policy):
    trace = synthetic(7, 800)
    cap, at = replay.min_capacity(trace, policy)
    assert at.ok and cap % replay.CAPACITY_STEP == 0
    assert cap >= at.peak_live_bytes
    assert not replay.run(trace, policy, cap - replay.CAPACITY_STEP).ok  # one step less fails
    free = replay.run(trace, policy)
    assert cap <= free.peak_reserved_bytes + replay.CAPACITY_STEP


def test_replay_rejects_a_broken_trace():
    t = Trace(meta={"n_ids": 0})
    t.append(OP_FREE, id=0, size=10)
    with pytest.raises(ValueError, match="event 0"):
        replay.run(t, "npu_pool")


def test_fidelity_on_a_real_trace(shared_traces):
    from npu_pool.trace.files import open_traces

    (name, trace), = open_traces(shared_traces / "cs336-medium-ctx128-train.pickle")
    v = replay.validate(trace, name)
    assert v.reserved_error <= 0.01
    assert v.segments_error <= 0.02
    assert v.same_place > 0.95


def test_cli_replay_json(tmp_path, capsys):
    path, marked = tmp_path / "t.npt", tmp_path / "m.npt"
    synthetic(11).save(path)
    t, m = synthetic(12), Trace(meta={"origin": "marked"})
    for i, e in enumerate(t.events()):  # the same with an iteration marker every 150 events
        if i and i % 150 == 0:
            m.append(OP_MARK, cat=MARK_ITER_BEGIN, id=i // 150)
        m.append(e.op, id=e.id, size=e.size, stream=e.stream, site=e.site, cat=e.cat, addr=e.addr)
    m.meta.update(n_ids=t.meta["n_ids"], sites=t.meta["sites"])
    m.save(marked)
    out = tmp_path / "r.json"
    assert main(["replay", str(path), str(marked), "--policy", "torch,npu_pool", "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    assert [(r["trace"], r["policy"]) for r in records] == [(n, p) for n in ("t", "m") for p in ("torch", "npu_pool")]
    assert [r["iteration_calls"] is None for r in records] == [True, True, False, False]
    assert all(len(r["iteration_calls"]) == 1 + len(replay.iteration_bounds(m)) for r in records[2:])
    keys = {"trace", "policy", "peak_live_bytes", "peak_reserved_bytes", "utilization", "min_capacity_bytes",
            "retries_at_min_capacity", "device_mallocs", "ops", "ns_per_op", "calls", "calls_at_min_capacity",
            "iteration_calls", "iteration_peak_live"}
    for r in records:
        assert set(r) == keys
        if r["iteration_calls"] is not None:  # per iteration, they add up to the run's calls
            assert {k: sum(d[k] for d in r["iteration_calls"]) for k in r["calls"]} == r["calls"]
            assert len(r["iteration_peak_live"]) == len(r["iteration_calls"])
            assert max(r["iteration_peak_live"]) == r["peak_live_bytes"]
        assert r["utilization"] == pytest.approx(r["peak_live_bytes"] / r["peak_reserved_bytes"])
        assert r["peak_live_bytes"] <= r["min_capacity_bytes"] <= r["peak_reserved_bytes"] + replay.CAPACITY_STEP
    assert "npu_pool" in capsys.readouterr().out


def test_cli_replay_bad_input(tmp_path, capsys):
    bad = tmp_path / "bad.npt"
    bad.write_bytes(b"garbage")
    assert main(["replay", str(bad)]) == 1
    assert "error" in capsys.readouterr().err
    assert main(["replay", str(bad), "--policy", "nope"]) == 2  # (the command line)


def test_cuda_rules_place_segments_as_cudamalloc_does():
    """Under CUDA's rules the simulated device places a malloc as the CUDA driver placed every
    segment recorded on an H100 (docs/gpu.md): 32 MiB granules of address space taken top down, a
    request under a granule at the low end of the lowest free range inside a granule already in
    use, others on the highest whole granules free; under torch_npu's rules, the
    next range up."""
    G = 32 * MiB

    def segments(rules: str) -> list[int]:
        with Pool("torch", capacity=1 << 34, rules=rules) as pool:
            a = pool.malloc(20 * MiB)   # a 20 MiB segment: a granule of its own
            s = pool.malloc(512 << 10)  # a 2 MiB segment (the small pool): the rest of a's granule
            c = pool.malloc(20 * MiB)   # the next granule down
            d = pool.malloc(64 * MiB)   # two whole granules below it
            e = pool.malloc(12 * MiB)   # a's granule has 10 MiB left, c's 12: c's
            pool.free(c)
            pool.empty_cache()          # c's segment goes back; its granule still holds e
            f = pool.malloc(16 * MiB)   # the lowest free range in a granule in use: c's old place
            g = pool.malloc(40 * MiB)   # over a granule: the next two whole ones down
            return [a, s, c, d, e, f, g]

    for rules in ("cuda", "auto"):  # (the simulator's own rules are CUDA's)
        a, s, c, d, e, f, g = segments(rules)
        assert a % G == 0 and s == a + 20 * MiB
        assert c == a - G and d == c - 2 * G
        assert e == c + 20 * MiB and f == c
        assert g == d - 2 * G
    addrs = segments("npu")
    assert addrs[:5] == sorted(addrs[:5]) and addrs[5] > addrs[4] and addrs[6] > addrs[5]  # bottom up, none reused


def test_replay_shows_the_calls_of_the_steady_iterations() -> None:
    """Device calls per iteration (#19): `replay` prints, beside each policy's calls, those of the
    steady iterations given room to spare; '-' for a trace that does not repeat."""
    from npu_pool.capture import capture
    from npu_pool.commands.replay import format_calls
    from npu_pool.device_costs import load_costs

    t = capture(steps=4, progress=False)
    assert len(replay.iteration_bounds(t)) == 4
    r = replay.evaluate(t, "gpt", "torch", with_min_capacity=False, bounds=replay.iteration_bounds(t))
    steady = replay.steady_stretches(r.iteration_peak_live)
    assert len(r.iteration_calls) == 5 and r.steady_calls == sum(sum(d.values()) for d, s in zip(r.iteration_calls, steady) if s)
    assert sum(sum(d.values()) for d in r.iteration_calls) == sum(r.calls.values()) and any(r.iteration_calls[1].values())
    once = Trace(meta={"n_ids": 1})
    once.append(OP_ALLOC, id=0, size=1 << 20)
    once.append(OP_FREE, id=0, size=1 << 20)
    flat = replay.evaluate(once, "once", "torch", with_min_capacity=False, bounds=replay.iteration_bounds(once))
    assert flat.iteration_calls is None and flat.steady_calls is None
    lines = format_calls([r, flat], load_costs(None)).splitlines()
    col = lines[0].index("steady")
    assert lines[2][col - 1:col + 6].strip() == str(r.steady_calls) and lines[3][col - 1:col + 6].strip() == "-"


def test_an_iteration_that_raises_the_live_peak_is_not_steady() -> None:
    """Steady iterations (#19's bound of no device calls in them): every iteration after the first
    that needs no more live memory than an earlier one. The second iteration of a run whose
    optimizer makes its states at the end of the first needs more than the first held, so an
    allocator that holds only what was live maps there; from the third on it maps nothing."""
    MiB = 1 << 20
    t = Trace(meta={"n_ids": 5})
    t.append(OP_MARK, cat=MARK_ITER_BEGIN, id=-1)
    t.append(OP_ALLOC, id=0, size=100 * MiB)  # activations
    t.append(OP_FREE, id=0, size=100 * MiB)
    t.append(OP_ALLOC, id=1, size=50 * MiB)  # the optimizer's states, made at the first step's end
    for i in range(2, 5):
        t.append(OP_MARK, cat=MARK_ITER_BEGIN, id=-1)
        t.append(OP_ALLOC, id=i, size=100 * MiB)
        t.append(OP_FREE, id=i, size=100 * MiB)
    bounds = replay.iteration_bounds(t)
    assert bounds == [0, 4, 7, 10]
    r = replay.evaluate(t, "adam", "npu_pool", with_min_capacity=False, bounds=bounds)
    assert r.iteration_peak_live == [0, 100 * MiB, 150 * MiB, 150 * MiB, 150 * MiB]
    assert replay.steady_stretches(r.iteration_peak_live) == [False, False, False, True, True]
    assert sum(r.iteration_calls[2].values()) > 0  # the second iteration grows the arena
    assert r.steady_calls == 0 and sum(sum(d.values()) for d in r.iteration_calls[3:]) == 0
    # a later iteration that needs more again is not steady either
    assert replay.steady_stretches([0, 5, 5, 7, 6, 7]) == [False, False, True, False, True, True]
    assert replay.steady_calls(None, [0, 1]) is None and replay.steady_calls([{}, {}], None) is None
    # where every iteration needs more than all before it (a leak) none is steady: no figure, not 0
    leak = Trace(meta={"n_ids": 6})
    for i in range(6):
        leak.append(OP_MARK, cat=MARK_ITER_BEGIN, id=-1)
        leak.append(OP_ALLOC, id=i, size=30 * MiB)
    r = replay.evaluate(leak, "leak", "torch", with_min_capacity=False, bounds=replay.iteration_bounds(leak))
    assert r.iteration_calls is not None and sum(sum(d.values()) for d in r.iteration_calls[2:]) > 0
    assert r.steady_calls is None


def test_iteration_bounds_past_the_trace_and_failed_runs() -> None:
    """Bounds are event indices of the trace (one at or past its end would make a stretch the replay
    never enters); a run that fails reports the stretches it entered, whose calls add up to its own,
    and no peaks (the last one's request was not served: no steady figure)."""
    MiB = 1 << 20
    t = Trace(meta={"n_ids": 4})
    for i in range(4):
        t.append(OP_MARK, cat=MARK_ITER_BEGIN, id=-1)
        t.append(OP_ALLOC, id=i, size=(i + 1) * 30 * MiB)
        t.append(OP_FREE, id=i, size=(i + 1) * 30 * MiB)
    for bad in ([0, 3, 12], [0, 100], [-1, 3], [3, 0]):
        with pytest.raises(ValueError, match="increasing indices of the trace's 12 events"):
            replay.run(t, "npu_pool", bounds=bad)
    r = replay.run(t, "npu_pool", capacity=64 * MiB, bounds=[0, 3, 6, 9])
    assert not r.ok and r.fail_index == 7  # the third iteration's 90 MiB
    assert len(r.iteration_calls) == 4 and r.iteration_peaks is None  # before 0, then three entered
    assert all(n >= 0 for d in r.iteration_calls for n in d.values())
    assert {k: sum(d[k] for d in r.iteration_calls) for k in r.calls} == r.calls
    assert replay.steady_calls(r.iteration_calls, r.iteration_peaks) is None


def test_a_window_of_frees_only_replays(tmp_path, capsys) -> None:
    """A recording whose window holds only frees of tensors made before it (OP_INIT_ALLOC): the
    iteration bounds asked the planner for a loop body it cannot find in a trace with no request,
    and `replay` refused the trace ("no allocations to plan") that analyze and export read."""
    MiB = 1 << 20
    t = Trace(meta={"n_ids": 3})
    for i in range(3):
        t.append(OP_INIT_ALLOC, id=i, size=(i + 1) * MiB, addr=(i + 1) << 30)
    for i in range(3):
        t.append(OP_FREE, id=i, size=(i + 1) * MiB)
    assert replay.iteration_bounds(t) == []
    t.save(tmp_path / "frees.npt")
    assert main(["replay", str(tmp_path / "frees.npt"), "--json", str(tmp_path / "r.json")]) == 0
    rows = json.loads((tmp_path / "r.json").read_text())
    assert len(rows) == 3 and all(r["peak_live_bytes"] == 6 * MiB and r["iteration_calls"] is None for r in rows)
    # the planned policy asked for too: nothing to plan, so its row runs online, and the other rows stay
    # (the whole command failed on "the trace has no allocations to plan", its other traces' rows lost)
    assert main(["replay", str(tmp_path / "frees.npt"), "--policy", "npu_pool,planned", "--json",
                 str(tmp_path / "r2.json")]) == 0
    rows = json.loads((tmp_path / "r2.json").read_text())
    assert [r["policy"] for r in rows] == ["npu_pool", "planned"]
    assert rows[0]["peak_reserved_bytes"] == rows[1]["peak_reserved_bytes"]
    assert "planned on frees: runs online (no plan: the trace has no allocations to plan)" in capsys.readouterr().out


def test_a_trace_of_markers_costs_no_table_per_marker() -> None:
    """A trace's iteration markers decide how many per-iteration tables evaluate keeps: past
    replay.MAX_ITERATIONS it keeps none (a small file of markers would otherwise cost a table each)."""
    t = Trace(meta={"n_ids": 1})
    t.append(OP_ALLOC, id=0, size=1 << 20)
    for _ in range(replay.MAX_ITERATIONS + 1):
        t.append(OP_MARK, cat=MARK_ITER_BEGIN, id=-1)
    t.append(OP_FREE, id=0, size=1 << 20)
    r = replay.evaluate(t, "marks", "torch", with_min_capacity=False, bounds=replay.iteration_bounds(t))
    assert r.iteration_calls is None and r.steady_calls is None and sum(r.calls.values()) > 0


def test_tables_keep_whole_trace_names_and_tell_same_named_files_apart(tmp_path, capsys) -> None:
    """Names were cut at 25 characters, so the devices of one snapshot (name.dev0, name.dev1) with a
    long name printed alike, and two folders' run.npt printed as "run" twice (analyze told them
    apart by folder; replay now does too)."""
    long = "llama7b-offload-inference-rank0-of-a-long-run"
    paths = []
    for folder, name in (("a", "run"), ("b", "run"), ("c", long)):
        (tmp_path / folder).mkdir()
        synthetic(3).save(tmp_path / folder / f"{name}.npt")
        paths.append(str(tmp_path / folder / f"{name}.npt"))
    assert main(["replay", *paths, "--policy", "torch", "--no-min-capacity"]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines() if line.split()[1:2] == ["torch"]]
    assert rows[:3] == ["run", "b/run", long], out


def test_same_named_traces_get_distinct_names_however_deep_their_folders() -> None:
    from pathlib import Path

    from npu_pool.trace.files import distinct_name

    seen: dict = {}
    paths = ("x/a/run.npt", "y/a/run.npt", "z/a/run.npt", "z/a/run.npt")
    assert [distinct_name("run", Path(p), seen) for p in paths] == ["run", "y/a/run", "z/a/run", "run (2)"]


@pytest.mark.parametrize("seg_size, alloc_at", [(2 << 20, 100), (1000, 0), (0, 0), ((2 << 20) + 1, 0)])
def test_an_initial_state_off_the_allocators_grid_is_refused(seg_size: int, alloc_at: int) -> None:
    """A fidelity replay places the initial state where it was recorded: a segment or block off the 512-byte
    grid every allocator places on broke the core's tiling (the debug build aborted; the release build
    replayed it, blocks at odd offsets). Such a trace is refused when validated (a review, a helper)."""
    from npu_pool.trace.format import OP_INIT_ALLOC, OP_INIT_SEGMENT, Trace, TraceError

    base = 1 << 40
    t = Trace(meta={"n_ids": 2})
    t.append(OP_INIT_SEGMENT, size=seg_size, cat=0, addr=base)
    t.append(OP_INIT_ALLOC, id=0, size=512, addr=base + alloc_at)
    t.append(OP_ALLOC, id=1, size=1000)
    with pytest.raises(TraceError, match="off the 512-byte grid"):
        t.validate()
