"""docs/gpu.md against what was measured on the GPU (benchmarks/results/h100-2026-11-25) and what
the simulator says now: every table row of `benchmarks/gpu_report.py` is on the page, and the
simulator equals the live runs on the real CUDA caching allocator and on npu_pool (peak reserved,
minimum capacity, device allocations) for every shared trace."""
from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "h100-2026-11-25"


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


def test_the_simulator_equals_the_live_gpu_runs(shared_traces: Path) -> None:
    text = _report(shared_traces)
    assert "All three figures equal on 18 of 18 rows." in text
    page = (ROOT / "docs" / "gpu.md").read_text()
    missing = [line for line in text.splitlines() if line.startswith("|") and line not in page]
    assert not missing, f"docs/gpu.md lacks {len(missing)} rows of the report, e.g. {missing[0]}"


def test_on_a_full_device_each_iteration_made_the_calls_the_simulator_says(shared_traces: Path) -> None:
    """The H100 session of 2026-11-26 (docs/gpu.md, "A full device"): the live replays equal the
    simulator of this checkout on every row; every npu_pool trace replayed on the device the torch
    model just fits made, iteration by iteration, the calls the simulator said (recorded beside
    them); the page shows every row, and the H200 experiment's tables too."""
    text = _report(shared_traces, RESULTS.parent / "h100-2026-11-26")
    assert "All three figures equal on 18 of 18 rows." in text
    steady = [line for line in text.splitlines() if line.startswith("| ") and "| npu_pool | " in line and ", " in line]
    assert len(steady) == 4 and all("| yes |" in line for line in steady), steady
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


def test_replaying_the_h100_recording_gives_what_both_allocators_reserved_training() -> None:
    """The recording of the native run (benchmarks/traces) replayed through the torch model and
    through the npu_pool policy gives, to the byte, the peaks each allocator reached training
    the same model on the H100 (record.json: the same 10 steps under each). npu_pool's live run
    saw no markers: the replay leaves the recording's optimizer annotations out (hints none)."""
    import json

    from npu_pool.replay import run
    from npu_pool.trace.files import open_traces

    (_, trace), = open_traces(ROOT / "benchmarks" / "traces" / "h100-gpt-bf16-train.pickle")
    live = json.loads((RESULTS / "record.json").read_text())["runs"]
    torch_model = run(trace, "torch", device="cuda")
    assert torch_model.peak_reserved_bytes == live["native"]["peak_reserved"]
    assert torch_model.stats["total"]["allocated"]["peak"] == live["native"]["peak_allocated"]
    assert torch_model.device_mallocs == live["native"]["calls"]["num_device_alloc"]
    pool = run(trace, "npu_pool", device="cuda", hints="none")
    assert pool.peak_reserved_bytes == live["npu_pool"]["peak_reserved"]
    assert pool.stats["total"]["allocated"]["peak"] == live["npu_pool"]["peak_allocated"]
    assert pool.device_mallocs == live["npu_pool"]["calls"]["phys_create"]
