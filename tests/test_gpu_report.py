"""docs/gpu.md against what was measured on the GPU (benchmarks/results/h100-*) and what the
simulator says now: every table row of `benchmarks/gpu_report.py` is on the page, and the
simulator equals the live runs on the real CUDA caching allocator and on npu_pool (peak reserved
and allocated, minimum capacity, device allocations) for every shared trace and the H100
recording."""
from __future__ import annotations

import contextlib
import importlib
import io
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "h100-2026-11-25"
LATEST = RESULTS.parent / "h100-2026-11-26b"  # the torch model with cudaMalloc's granules
# npu_pool's own changes since a run: rows whose live figures equal the simulation saved with the
# run and differ from this checkout's npu_pool policy. Since 2026-11-27 free memory of two streams
# merges only under cap pressure (arena.c): given room, the one trace of several streams places
# differently. Since 2026-11-28 a request goes back to the last place of its place key (arena.c,
# placed_again): the H100 recording, the one trace of these runs with markers, places differently.
CHANGED_SINCE = ["h100-gpt-bf16-train", "llama7b-offload-infer"]


def _agrees(text: str, rows: int) -> bool:
    """The live table's summary: every row equal, but npu_pool's rows of CHANGED_SINCE (those of the
    traces the run replayed)."""
    changed = [n for n in CHANGED_SINCE if re.search(rf"^\| {n} \| npu_pool \| \d+ / \d+ \|", text, re.M)]
    k = len(changed)
    return (f"on {rows - k} of {rows} rows; on {k} more (npu_pool: {', '.join(changed)}) the live run "
            f"equals the simulation saved with it" in text and "| NO |" not in text)


def _steady_agrees(rows: list[str]) -> bool:
    """The per-iteration table: every row the same, but npu_pool's rows of CHANGED_SINCE, which may
    say "changed since" (the live calls equal the probe's simulation saved with them)."""
    return all("| yes |" in line or "| changed since |" in line and
               any(line.startswith(f"| {n} | npu_pool") for n in CHANGED_SINCE) for line in rows)


def _report(shared: Path, results: Path = RESULTS) -> str:
    """What ``python benchmarks/gpu_report.py RESULTS --shared SHARED`` prints."""
    saved = list(sys.path)
    out = io.StringIO()
    try:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import gpu_report  # (it puts the benchmarks on the path itself; all of it is taken back below)

        with contextlib.redirect_stdout(out):
            assert gpu_report.main([str(results), "--shared", str(shared)]) == 0
    finally:
        sys.path[:] = saved
    return out.getvalue()


def _benchmark(name: str) -> Any:
    """A module of benchmarks/, imported with the path put back after."""
    saved = list(sys.path)
    try:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        return importlib.import_module(name)
    finally:
        sys.path[:] = saved


def _three_repeats_hold(folder: Path) -> None:
    """The GPU-bound model's three saved repeats: losses identical, no device call from the third
    step on, each step-time ratio within the goal (<= 1.01)."""
    median_step = _benchmark("gpu_check").median_step
    ratios = []
    for f in sorted(folder.glob("repeat_mid_*.json")):
        runs = json.loads(f.read_text())["runs"]
        assert runs["native"]["losses"] == runs["npu_pool"]["losses"]
        assert all(sum(r["step_calls"][2:]) == 0 for r in runs.values())
        ratios.append(median_step(runs["npu_pool"]["step_s"]) / median_step(runs["native"]["step_s"]))
    assert len(ratios) == 3 and max(ratios) <= 1.01, ratios


def test_the_simulator_equals_the_live_gpu_runs(shared_traces: Path) -> None:
    text = _report(shared_traces)
    assert _agrees(text, 18)
    page = (ROOT / "docs" / "gpu.md").read_text()
    missing = [line for line in text.splitlines() if line.startswith("|") and line not in page]
    assert not missing, f"docs/gpu.md lacks {len(missing)} rows of the report, e.g. {missing[0]}"


def test_on_a_full_device_each_iteration_made_the_calls_the_simulator_says(shared_traces: Path) -> None:
    """The H100 session of 2026-11-26 (docs/gpu.md, "A full device"): the live replays equal the
    simulator of this checkout on every row; every npu_pool trace replayed on the device the torch
    model just fits made, iteration by iteration, the calls the simulator said (recorded beside
    them); the page shows every row, and the H200 experiment's tables too."""
    text = _report(shared_traces, RESULTS.parent / "h100-2026-11-26")
    assert _agrees(text, 18)
    steady = [line for line in text.splitlines() if line.startswith("| ") and "| npu_pool | " in line and ", " in line]
    assert len(steady) == 4 and _steady_agrees(steady), steady
    page = (ROOT / "docs" / "gpu.md").read_text()
    for results, shared in ((RESULTS.parent / "h100-2026-11-26", shared_traces),
                            (RESULTS.parent / "h200-2026-11-26" / "ab", Path("/nonexistent")),
                            (RESULTS.parent / "h200-2026-11-26" / "ab2", Path("/nonexistent"))):
        rows = [line for line in _report(shared, results).splitlines() if line.startswith("|")]
        missing = [line for line in rows if line not in page]
        assert rows and not missing, f"docs/gpu.md lacks {len(missing)} rows of {results.name}'s report, e.g. {missing[:1]}"


def test_report_without_the_shared_traces_keeps_the_training_tables(tmp_path: Path) -> None:
    text = _report(tmp_path / "absent")
    assert "## Live replay" not in text
    assert "| losses identical, step by step (200 steps) | yes | |" in text
    page = (ROOT / "docs" / "gpu.md").read_text()
    assert all(line in page for line in text.splitlines() if line.startswith("|"))


def test_measured_costs_are_a_cost_table() -> None:
    """The H100's measured per-call costs load as a --costs table (microseconds, kinds of the vocabulary)."""
    from npu_pool.device_costs import load_costs

    costs = load_costs(str(RESULTS / "costs.json"))
    assert costs["map"][0] < costs["phys_create"][0] < costs["malloc"][0]
    assert costs["map"][1].startswith("given in") and costs["get_device"][1].startswith("assumed")


def test_the_torch_model_places_segments_as_the_cuda_driver_did(shared_traces: Path) -> None:
    """The session of 2026-11-26b (docs/gpu.md, "cudaMalloc's granules"): with the driver's
    32 MiB granules in the simulated device, the torch model equals the real caching allocator on
    every live row, the H100 recording included (its minimum capacity was 48 MiB low before), and on
    the device it just fits every iteration of every repeating trace made, kind by kind, the calls
    the simulator says, under both allocators; the page shows every row."""
    text = _report(shared_traces, LATEST)
    assert _agrees(text, 20) and "| h100-gpt-bf16-train | native | 2334130176 / 2334130176 | " \
        "2317352960 / 2317352960 | 71 / 71 | yes |" in text
    steady = [line for line in text.splitlines()
              if line.startswith("| ") and ("| native | " in line or "| npu_pool | " in line) and ", " in line]
    assert len(steady) == 8 and _steady_agrees(steady), steady
    page = (ROOT / "docs" / "gpu.md").read_text()
    missing = [line for line in text.splitlines() if line.startswith("|") and line not in page]
    assert not missing, f"docs/gpu.md lacks {len(missing)} rows of the report, e.g. {missing[0]}"


def test_replaying_the_h100_recording_gives_what_each_run_of_it_reached() -> None:
    """The recording of the native run (benchmarks/traces) replayed through the torch model with its
    own segment addresses gives, to the byte, what the caching allocator reached training (record.json:
    the same 10 steps under each allocator); with the addresses cudaMalloc gives a new process, what
    it reached replaying the recording as tensors (the live row of 2026-11-26b). The two differ by a
    2 MiB block: training's address space held more than its segments, so ties fell another way.
    The npu_pool policy gives what npu_pool reached training (its live run saw no markers: the
    replay leaves the recording's optimizer annotations out, hints none)."""
    import json

    from npu_pool.replay import run
    from npu_pool.trace.files import open_traces

    (_, trace), = open_traces(ROOT / "benchmarks" / "traces" / "h100-gpt-bf16-train.pickle")
    training = json.loads((RESULTS / "record.json").read_text())["runs"]
    at_recorded = run(trace, "torch", device="cuda", fidelity=True)
    assert at_recorded.same_addr == at_recorded.compared > 0
    assert at_recorded.peak_reserved_bytes == training["native"]["peak_reserved"]
    assert at_recorded.stats["total"]["allocated"]["peak"] == training["native"]["peak_allocated"]
    assert at_recorded.device_mallocs == training["native"]["calls"]["num_device_alloc"]
    (replayed,) = [r for r in json.loads((LATEST / "live_h100-gpt-bf16-train.json").read_text())
                   if r["allocator"] == "native"]
    model = run(trace, "torch", device="cuda")
    assert (model.peak_reserved_bytes, model.stats["total"]["allocated"]["peak"], model.device_mallocs) == \
        (replayed["peak_reserved_bytes"], replayed["peak_allocated_bytes"], replayed["device_allocs"])
    assert replayed["peak_allocated_bytes"] - training["native"]["peak_allocated"] == 2 << 20
    pool = run(trace, "npu_pool", device="cuda", hints="none")
    assert pool.peak_reserved_bytes == training["npu_pool"]["peak_reserved"]
    assert pool.stats["total"]["allocated"]["peak"] == training["npu_pool"]["peak_allocated"]
    assert pool.device_mallocs == training["npu_pool"]["calls"]["phys_create"]


def test_validate_says_same_only_when_every_figure_agrees() -> None:
    """`replay --live --validate`'s verdict (live.simulated): the H100 recording's live row of
    2026-11-26b agrees with the simulator on every figure; the same row with its minimum capacity
    48 MiB lower (what the simulator said before the granules), or a peak allocated, or a device
    allocation count off by one, is not 'same', though its peak reserved still agrees."""
    import dataclasses
    import json

    from npu_pool.live import LiveResult, simulated
    from npu_pool.trace.files import open_traces

    (_, trace), = open_traces(ROOT / "benchmarks" / "traces" / "h100-gpt-bf16-train.pickle")
    rec = [r for r in json.loads((LATEST / "live_h100-gpt-bf16-train.json").read_text()) if r["allocator"] == "native"][0]
    rec.pop("simulated")
    live = LiveResult(**rec)
    assert simulated(trace, live)["same"]
    for change in ({"min_capacity_bytes": live.min_capacity_bytes - (48 << 20)},
                   {"peak_allocated_bytes": live.peak_allocated_bytes - (2 << 20)},
                   {"device_allocs": live.device_allocs + 1}):
        sim = simulated(trace, dataclasses.replace(live, **change))
        assert sim["peak_reserved_bytes"] == live.peak_reserved_bytes and not sim["same"], change


def test_waiting_for_busy_streams_the_gpu_made_the_simulators_calls_step_by_step() -> None:
    """The third call of 2026-11-26b (docs/gpu.md): with the arena waiting for a busy stream, the
    small model trained at 2162 and 2226 MiB made in steps 2-10, in every run, the device calls the
    simulator makes in iterations 2-10 of the recording of that model, capped by the same fraction
    (the live run had no optimizer markers: hints none); at 2162 MiB it fit every run."""
    import json
    import re

    from npu_pool.live import cap_fraction
    from npu_pool.replay import iteration_bounds, run
    from npu_pool.trace.files import open_traces

    (_, trace), = open_traces(ROOT / "benchmarks" / "traces" / "h100-gpt-bf16-train.pickle")
    bounds, total = iteration_bounds(trace), 81559 << 20  # (the H100's memory; any total gives the cap)
    for cap, runs in ((2162, ("1", "1b", "2", "2b", "3", "3b")), (2226, ("1", "2"))):
        sim = run(trace, "npu_pool", total, device="cuda", bounds=bounds, hints="none",
                  fraction=cap_fraction(cap << 20, total))
        counted = ("phys_create", "phys_release", "map", "unmap")  # (what the live runs' step_calls count)
        simulated = [sum(d.get(k, 0) for k in counted) for d in sim.iteration_calls[2:11]]
        for name in runs:
            text = (LATEST / f"w_e1024_{cap}_{name}.log").read_text()
            live = json.loads(re.search(r"^RESULT (.*)$", text, re.M).group(1))["step_calls"]
            assert len(live) == 60 and live[1:10] == simulated, (cap, name, live[1:10], simulated)


def test_the_colocated_rows_of_the_page_are_the_saved_runs() -> None:
    """docs/gpu.md, "Colocated RL on the H100": every row's medians and ratios are those of the JSON
    file it names (benchmarks/results/h100-2026-11-26c), and every file's checks passed."""
    gpu_colocate = _benchmark("gpu_colocate")
    folder = RESULTS.parent / "h100-2026-11-26c"
    page = (ROOT / "docs" / "gpu.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| ") and line.rstrip().endswith(".json |")]
    assert len(rows) == 11
    for line in rows:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        res = json.loads((folder / cells[-1]).read_text())
        assert gpu_colocate.report(res)[1], cells[-1]
        want = []
        for key in ("offload_s", "load_s"):
            pm, nm = (gpu_colocate.median_ms(res[m], key) for m in ("npu_pool", "native"))
            want += [f"{pm:.1f} / {nm:.1f}", f"{pm / nm:.2f}x"]
        assert cells[1:5] == want, line


def test_this_checkout_on_the_h100_and_torchs_memory_apis(shared_traces: Path) -> None:
    """The session of 2026-11-26d (docs/gpu.md, "This checkout on the H100"): with the build of
    cea9572 the live replays still equal the simulator on every row and every iteration of the full
    device; the GPU-bound model's step-time ratios are those of the saved runs (losses identical,
    no device call from the third step on); every memory API answered under npu_pool as under the
    caching allocator; the page shows every row."""
    gpu_apis = _benchmark("gpu_apis")
    folder = RESULTS.parent / "h100-2026-11-26d"
    text = _report(shared_traces, folder)
    assert _agrees(text, 20)
    steady = [line for line in text.splitlines()
              if line.startswith("| ") and ("| native | " in line or "| npu_pool | " in line) and ", " in line]
    assert len(steady) == 8 and _steady_agrees(steady), steady
    _three_repeats_hold(folder)
    res = json.loads((folder / "apis.json").read_text())["runs"]
    table, agree = gpu_apis.report(res)
    assert agree and res["npu_pool"]["non_releasable_identity"] is True
    # graph capture: it overwrote a later tensor before (commit cea9572), it is refused now
    before = json.loads((folder / "apis_before.json").read_text())["runs"]
    assert before["native"]["graph_capture"] == res["native"]["graph_capture"] == \
        "captured; replay right; a tensor made after it intact"
    assert before["npu_pool"]["graph_capture"].endswith("a tensor made after it OVERWRITTEN")
    assert res["npu_pool"]["graph_capture"].startswith("raised PrivatePoolError: npu_pool: graph capture")
    assert res["native"]["compile_reduce_overhead"] == "ran; output right"  # torch.compile's CUDA graphs too
    assert res["npu_pool"]["compile_reduce_overhead"].startswith("raised PrivatePoolError: npu_pool: graph capture")
    for mode in ("native", "npu_pool"):  # what a busy stream still read stayed intact; the control saw a reuse
        assert res[mode]["record_stream"] == res[mode]["freed_on_another_stream"] == "right"
        assert res[mode]["control_without_record_stream"].startswith("WRONG")
    page = (ROOT / "docs" / "gpu.md").read_text()
    missing = [line for line in text.splitlines() + table.splitlines() if line.startswith("|") and line not in page]
    assert not missing, f"docs/gpu.md lacks {len(missing)} rows of the report, e.g. {missing[0]}"


def test_four_threads_on_their_own_streams(shared_traces: Path) -> None:
    """The session of 2026-11-27 (docs/gpu.md, "Four threads on their own streams"): with the build
    of 6705f3f, four threads on their own streams made npu_pool hand memory between streams (an
    event record and a stream wait) about every second request after warm-up, the caching allocator
    never; this checkout's npu_pool, on the same workload simulated (the threads taking turns),
    makes no device call after warm-up and reserves less than the torch model, whose peak is what
    the caching allocator reserved on the GPU. The rest as the session before (live replays, the full device, step
    time); the page shows every row."""
    folder = RESULTS.parent / "h100-2026-11-27"
    text = _report(shared_traces, folder)
    assert _agrees(text, 20)
    steady = [line for line in text.split("### Traces, iteration by iteration")[1].splitlines()
              if line.startswith("| ") and ("| native | " in line or "| npu_pool | " in line)]
    assert len(steady) == 8 and _steady_agrees(steady), steady
    _three_repeats_hold(folder)
    gpu = {f.stem: json.loads(f.read_text()) for f in folder.glob("threads_*.json")}
    assert len(gpu) == 4 and all(r["ok"] and r["requests_timed"] == 47808 for r in gpu.values())
    native = {r["peak_reserved"] for k, r in gpu.items() if "native" in k}
    assert all(r["calls_after_warm_up"] == {} for k, r in gpu.items() if "native" in k) and len(native) == 1
    before = [r["calls_after_warm_up"] for k, r in gpu.items() if "npu_pool" in k]
    assert all(c["event_wait"] == c["event_record"] > 47808 // 3 and set(c) == {"event_record", "event_wait"}
               for c in before), before
    now = {a: _benchmark("gpu_probe").threads_simulated(a, 4, 3) for a in ("native", "npu_pool")}
    assert now["native"]["calls_after_warm_up"] == {} == now["npu_pool"]["calls_after_warm_up"]
    assert {now["native"]["peak_reserved"]} == native and now["npu_pool"]["peak_reserved"] < min(native)
    page = (ROOT / "docs" / "gpu.md").read_text()
    missing = [line for line in text.splitlines() if line.startswith("|") and line not in page]
    assert not missing, f"docs/gpu.md lacks {len(missing)} rows of the report, e.g. {missing[0]}"


def test_a_live_row_that_differs_is_no_unless_npu_pool_changed_since(shared_traces: Path, tmp_path: Path) -> None:
    """The report's excuse for a differing row is narrow: an npu_pool row whose live figures equal
    the simulation saved with the run, figure by figure, while this checkout's differs from it
    (the policy changed since the run). A live figure off the saved simulation, or a model of
    another allocator that differs, is a NO."""
    rows = json.loads((RESULTS.parent / "h100-2026-11-27" / "live_cnn-adam-train.json").read_text())

    def same_column(rows: list[dict[str, Any]]) -> dict[str, str]:
        (tmp_path / "live_cnn-adam-train.json").write_text(json.dumps(rows))
        text = _report(shared_traces, tmp_path)
        return {a: text.split(f"| cnn-adam-train | {a} | ")[1].split("\n")[0].split("| ")[-1]
                for a in ("native", "npu_pool")}

    assert same_column(rows) == {"native": "yes |", "npu_pool": "yes |"}
    for r in rows:  # as if the live run had reserved one more page, the saved simulation not
        r["peak_reserved_bytes"] += 2 << 20
    assert same_column(rows) == {"native": "NO |", "npu_pool": "NO |"}
    for r in rows:  # and the saved simulation with it: the simulator of that day agreed
        r["simulated"]["peak_reserved_bytes"] += 2 << 20
    assert same_column(rows) == {"native": "NO |", "npu_pool": "changed since |"}


def test_the_report_reads_compaction_runs_of_the_probe(tmp_path: Path) -> None:
    """benchmarks/gpu_probe.py compact's JSON (no GPU has run it yet: these files are made here, in
    its format): a row per round with the copies' rate (live GiB moved per second of compact()), the
    queued-work round and the out-of-memory request as notes, tensors whose contents changed named;
    and a steady run with compaction is labelled so and simulated with compaction (the recording
    capped at its npu_pool minimum capacity, where the policy compacts)."""
    gpu_probe = _benchmark("gpu_probe")
    row = {"tensors": 180, "allocated": 4 << 30, "reserved": 8 << 30, "empty_cache_s": 0.002,
           "after_empty_cache": 7 << 30, "calls": {}, "changed": 0}
    (tmp_path / "compact_native.json").write_text(json.dumps(
        {"allocator": "native", "rounds": [row], "queued": {"tensors": 180, "changed": 0},
         "oom": {"cap": 7 << 30, "allocated": 4 << 30, "ask": 2 << 30, "fits": False, "changed": 0},
         "changed_at_end": 0}))
    (tmp_path / "compact_npu_pool.json").write_text(json.dumps(
        {"allocator": "npu_pool", "rounds": [dict(row, returned=2 << 30, compact_s=0.25, copied=1 << 29,
                                                  after_compact=5 << 30, changed=3)],
         "queued": {"tensors": 180, "compactions": 12, "returned": 1 << 30, "changed": 0},
         "oom": {"cap": 5 << 30, "allocated": 4 << 30, "ask": 768 << 20, "fits": False, "fits_compacting": True,
                 "compactions": 4, "seconds": 0.1, "changed": 0}, "changed_at_end": 0}))
    from npu_pool.replay import iteration_bounds, min_capacity
    from npu_pool.trace.files import open_traces

    (_, trace), *_ = open_traces(ROOT / "benchmarks" / "traces" / "h100-gpt-bf16-train.pickle")
    bounds, cap = iteration_bounds(trace), min_capacity(trace, "npu_pool", device="cuda", compact=True)[0]
    plain, compacting = (gpu_probe.simulate_capped(trace, "npu_pool", cap, 1 << 40, "cuda", bounds, c)
                         for c in (False, True))
    assert plain[2] == 0 < compacting[2] and plain[1] != compacting[1]  # (only the second compacts)
    run = {"trace": "h100-gpt-bf16-train.pickle", "allocator": "npu_pool", "compact": True, "device": "cuda",
           "cap_bytes": cap, "ok": True, "fail": None, "iteration_calls": compacting[1],
           "simulated_calls": compacting[1], "same": True, "seconds": [[0.001] * len(compacting[1])],
           "compactions": compacting[2]}
    # the same run, then one whose device compacted a chunk more than the simulator says (not the same)
    (tmp_path / "steady.log").write_text(json.dumps(run) + "\n" + json.dumps(dict(run, compactions=compacting[2] + 1)) + "\n")
    text = _report(tmp_path / "no-traces", tmp_path)
    assert ("| npu_pool | 1 | 180 | 4294967296 | 8589934592 | 7516192768 | 5368709120 | 512 | 0.002 | 0.250 | 2.00 | "
            "3 changed |") in text
    assert "| native | 1 | 180 | 4294967296 | 8589934592 | 7516192768 | - | - | 0.002 | - | - | intact |" in text
    assert "- npu_pool, work queued when it compacts: 180 tensors inverted in place behind the matrix products, " \
           "12 compactions, every tensor intact." in text
    assert "- native, work queued when it compacts: 180 tensors inverted in place behind the matrix products, " \
           "every tensor intact." in text
    assert "does not fit without compaction; with set_compaction(True) it fits (4 compactions, 0.100 s)" in text
    steady = [line for line in text.splitlines() if line.startswith("| h100-gpt-bf16-train | npu_pool, compacting |")]
    assert len(steady) == 2 and "| yes |" in steady[0] and "| no |" in steady[1], steady
