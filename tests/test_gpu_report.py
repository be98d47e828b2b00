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


def _report(shared: Path) -> str:
    """What ``python benchmarks/gpu_report.py RESULTS --shared SHARED`` prints."""
    saved = list(sys.path)
    out = io.StringIO()
    try:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import gpu_report  # (it puts the benchmarks on the path itself; all of it is taken back below)

        with contextlib.redirect_stdout(out):
            assert gpu_report.main([str(RESULTS), "--shared", str(shared)]) == 0
    finally:
        sys.path[:] = saved
    return out.getvalue()


def test_the_simulator_equals_the_live_gpu_runs(shared_traces: Path) -> None:
    text = _report(shared_traces)
    assert "All three figures equal on 18 of 18 rows." in text
    page = (ROOT / "docs" / "gpu.md").read_text()
    missing = [line for line in text.splitlines() if line.startswith("|") and line not in page]
    assert not missing, f"docs/gpu.md lacks {len(missing)} rows of the report, e.g. {missing[0]}"


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
