"""``npu-pool merge`` of rank reports: bad input, device-mode imbalance. The two-rank torchrun
run over the real Megatron-LM train_step is in tests/test_megatron_real.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from npu_pool.cli import main


def test_merge_rejects_missing_and_bad_reports(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["merge", str(tmp_path)]) == 1
    assert "no rank reports" in capsys.readouterr().err
    (tmp_path / "npu_pool_rank0.json").write_text("{not json")
    assert main(["merge", str(tmp_path)]) == 1
    assert "npu_pool_rank0.json: not a readable npu_pool rank report" in capsys.readouterr().err
    assert main(["merge", str(tmp_path / "absent")]) == 1
    assert "not a directory" in capsys.readouterr().err


def test_merge_table_reports_device_imbalance(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Device-mode reports (as a GPU/NPU run writes them): the rank with the highest peak is named;
    npu_pool's long/short columns are the bytes each class has allocated (their arena is shared:
    before, the columns read the pools' reserved bytes, always 0 under npu_pool)."""
    from npu_pool.recorder import report

    GiB = 1 << 30
    for rank, peak in enumerate((10 * GiB, 13 * GiB, 11 * GiB)):
        mem = {"allocated_bytes": peak // 2, "reserved_bytes": peak, "peak_allocated_bytes": peak * 9 // 10,
               "peak_reserved_bytes": peak, "utilization": 0.9,
               "pools": {"long": {"allocated_bytes": 3 * GiB, "reserved_bytes": 0},  # one shared arena
                         "short": {"allocated_bytes": 2 * GiB, "reserved_bytes": 0}},
               "device_mallocs": 3 + rank, "device_frees": 0, "ooms": 0, "retries": 0, "trims": 0}
        rep = {"version": report.VERSION, "rank": rank, "world_size": 4, "mode": "device", "iterations": 5,
               "step_seconds": {"mean": 1.0 + rank / 10}, "host_peak_rss_bytes": GiB, "memory": mem}
        (tmp_path / f"npu_pool_rank{rank}.json").write_text(json.dumps(rep))
    assert main(["merge", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "peak reserved   max 13.00 GiB on rank 1, min 10.00 GiB on rank 0, spread 26.5%" in out
    assert "warning: 3 reports for a world of 4 ranks (missing: 3)" in out
    row1 = next(ln.split() for ln in out.splitlines() if ln.split()[:2] == ["1", "device"])
    assert row1[4:10] == ["11.70", "13.00", "90.0%", "3.00", "2.00", "4"]


def test_merge_of_runs_outside_a_distributed_job_does_not_invent_missing_ranks(tmp_path: Path,
                                                                               capsys: pytest.CaptureFixture,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from npu_pool.recorder import report

    # outside a distributed job (this process may hold the megatron-core tests' gloo group)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert report.rank_and_world() == (0, None)
    for rank in (0, 1):
        rep = report.build(rank=rank, world_size=None, mode="recorder", reason="cpu", policy=None, device=None,
                           iterations=2, step_times=[0.1, 0.2], recorder_summary={}, stats=None)
        report.write(rep, tmp_path)
    assert main(["merge", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "warning" not in out and [ln.split()[0] for ln in out.splitlines()[2:4]] == ["0", "1"]


def test_merge_names_missing_ranks_as_ranges_however_large_the_world(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    """A report claiming a world of 2**31 - 1 ranks: the missing ones are ranges, a few named and
    the rest counted (listing them one by one took 22 GB of memory before it was killed)."""
    for rank in (0, 5, 9):
        rep = {"version": 1, "rank": rank, "world_size": 2147483647, "mode": "recorder", "iterations": 1}
        (tmp_path / f"npu_pool_rank{rank}.json").write_text(json.dumps(rep))
    assert main(["merge", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "warning: 3 reports for a world of 2147483647 ranks (missing: 1-4, 6-8, 10-2147483646)" in out
    for rank in range(12, 40, 2):
        (tmp_path / f"npu_pool_rank{rank}.json").write_text(json.dumps({**rep, "rank": rank}))
    assert main(["merge", str(tmp_path)]) == 0
    assert "(missing: 1-4, 6-8, 10-11, 13, 15, 17, 19, 21, ... (2147483630 in all))" in capsys.readouterr().out


def test_merge_warns_of_reports_written_before_their_rank_exited(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A rank killed by a signal runs no exit handler: its report is the one written during
    training, as of then. Merge says which ranks have only such a report; an older report without
    the field is taken as it is, and a field that is not true or false is refused."""
    for rank, final in ((0, True), (1, False), (2, None), (3, False)):
        rep = {"version": 1, "rank": rank, "world_size": 4, "mode": "recorder", "iterations": 1}
        if final is not None:
            rep["final"] = final
        (tmp_path / f"npu_pool_rank{rank}.json").write_text(json.dumps(rep))
    assert main(["merge", str(tmp_path)]) == 0
    assert "warning: no report written at exit by rank 1, 3 (killed by a signal" in capsys.readouterr().out
    (tmp_path / "npu_pool_rank3.json").write_text(json.dumps({**rep, "rank": 3, "final": "no"}))
    assert main(["merge", str(tmp_path)]) == 1
    assert "final should be true or false" in capsys.readouterr().err


def test_merge_refuses_a_rank_outside_its_world(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A report of rank 7 in a world of 4 made the missing ranks run past the world ('1-6')."""
    for rank in (0, 7):
        rep = {"version": 1, "rank": rank, "world_size": 4, "mode": "recorder", "iterations": 1}
        (tmp_path / f"npu_pool_rank{rank}.json").write_text(json.dumps(rep))
    assert main(["merge", str(tmp_path)]) == 1
    assert "rank 7 is outside its world of 4 ranks" in capsys.readouterr().err


def test_merge_takes_a_colocated_ranks_report(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A paused tag's tensors stay allocated while their memory is back with the device, so a
    colocated run's peak allocated passes its peak reserved: merge refused its report
    ("utilization should be at most 1"). It checks that the figures agree with each other."""
    from npu_pool import Pool
    from npu_pool.recorder import report

    GiB = 1 << 30
    with Pool("npu_pool", capacity=4 * GiB) as p:
        with p.region("train"):
            weights = p.malloc(GiB)
        p.pause("train")
        with p.region("rollout"):
            cache = p.malloc(GiB)
        mem = report.memory_of(p.stats())
        p.free(cache)
        p.resume("train")
        p.free(weights)
    assert mem["utilization"] == 2.0
    rep = {"version": report.VERSION, "rank": 0, "mode": "device", "iterations": 1, "memory": mem}
    (tmp_path / "npu_pool_rank0.json").write_text(json.dumps(rep))
    assert main(["merge", str(tmp_path)]) == 0
    assert "200.0%" in capsys.readouterr().out
