"""A real two-process data-parallel run (``torchrun --nproc-per-node 2``, gloo) with
``MEMORY_FRAGMENTATION=1``: each rank logs its per-iteration line and writes its report,
``npu-pool merge`` puts the ranks in one table.

On CPU there is no device allocator: ``mindspeed_patch`` warns and installs nothing, the
Megatron patch runs in recorder mode (markers, step times, host RSS). Training goes through
the Megatron-LM stand-in of ``npu_pool.recorder._mcore_cpu`` over megatron-core's GPTModel
(the project's GPT where megatron-core is not installed), wrapped in torch DDP."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from npu_pool.cli import main
from npu_pool.recorder import _mcore_cpu

ROOT = Path(__file__).resolve().parents[1]
ITERS = 3

SCRIPT = '''
import os, sys, warnings
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "standin"))
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|full scope|deprecated|tp_group).*")
import mindspeed_patch  # installs the pool with MEMORY_FRAGMENTATION=1 (here: warns, CPU)
from mindspeed_patch.megatron import patch_megatron
patch_megatron()
import torch
from npu_pool.recorder import _mcore_cpu as mc
rank = int(os.environ["RANK"])
batch = 2 + 2 * rank  # rank 1 gets twice the micro-batch size: an imbalance for the merged table
if mc.available():  # megatron-core's GPTModel
    mc.init(seed=0)
    provider = lambda: mc.gpt(layers=2, hidden=64, heads=4, vocab=256, seq=32)
    forward_step, data = mc.forward_step(256, 32, batch), mc.data(256, 32, batch, seed=rank)
else:  # the project's GPT
    from npu_pool.workloads import build_model
    torch.distributed.init_process_group("gloo")
    torch.manual_seed(0)
    provider = lambda: build_model("gpt", n_layers=2, dim=64, n_heads=4, vocab=256, max_seq=32)
    gen = torch.Generator().manual_seed(rank)
    data = iter(lambda: torch.randint(256, (batch, 33), generator=gen), None)

    def forward_step(data_iterator, model):
        x = next(data_iterator)
        return model(x[:, :-1], x[:, 1:]), lambda loss: (loss, {"lm loss": loss.detach()})
import megatron.training.training as training
cfg = dict(num_microbatches=2, train_iters=ITERS, eval_interval=ITERS, eval_iters=1)
iters, model, _ = training.pretrain(provider, forward_step, data, cfg)
w = torch.cat([p.detach().flatten() for p in model[0].parameters()])
both = [torch.zeros_like(w), torch.zeros_like(w)]
torch.distributed.all_gather(both, w)
print(f"rank {rank}: trained {iters} iterations, parameters equal across ranks: {torch.equal(both[0], both[1])}",
      flush=True)
torch.distributed.destroy_process_group()
'''.replace("ITERS", str(ITERS))


def test_torchrun_two_ranks_report_and_merge(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _mcore_cpu.write_training_standin(tmp_path / "standin")
    (tmp_path / "train.py").write_text(SCRIPT)
    reports = tmp_path / "reports"
    env = {**os.environ, "MEMORY_FRAGMENTATION": "1", "NPU_POOL_REPORT_DIR": str(reports), "NPU_POOL_LOG_EVERY": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    # `python -m torch.distributed.run` is the torchrun console script
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py"]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: trained {ITERS} iterations, parameters equal across ranks: True" in r.stdout
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith(f"[npu_pool rank {rank}] iter ")]
        want = [f"[npu_pool rank {rank}] iter {i}" for i in range(1, ITERS + 1)]
        assert [ln.split(" | ")[0] for ln in lines] == want, r.stdout
        assert all("recorder mode (no device allocator)" in ln for ln in lines)
    assert r.stderr.count("npu_pool was not installed") == 2 and r.stderr.count("no device allocator is installed") == 2

    files = sorted(p.name for p in reports.iterdir())
    assert files == ["npu_pool_rank0.json", "npu_pool_rank1.json"]
    ranks = [json.loads((reports / f).read_text()) for f in files]
    for rank, rep in enumerate(ranks):
        assert (rep["rank"], rep["world_size"], rep["iterations"], rep["mode"]) == (rank, 2, ITERS, "recorder")
        assert rep["memory"] is None and rep["host_peak_rss_bytes"] > 0 and rep["marks"] > 0
        assert {"setup", "forward", "backward", "optimizer", "eval"} <= set(rep["phase_seconds"])

    capsys.readouterr()
    assert main(["merge", str(reports), "--json", str(tmp_path / "merged.json")]) == 0
    out = capsys.readouterr().out
    table = out.splitlines()
    assert table[0].split()[:4] == ["rank", "mode", "iters", "step"]
    rows = [ln.split() for ln in table[2:4]]
    assert [row[:3] for row in rows] == [["0", "recorder", str(ITERS)], ["1", "recorder", str(ITERS)]]
    assert "imbalance across ranks" in out and "step time" in out and "host peak RSS" in out
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert [x["rank"] for x in merged["ranks"]] == [0, 1]
    step = next(x for x in merged["imbalance"] if x["figure"] == "step time")
    means = [rep["step_seconds"]["mean"] for rep in ranks]
    assert (step["max"], step["min"]) == (max(means), min(means))
    assert step["spread"] == pytest.approx((max(means) - min(means)) / (sum(means) / 2))


def test_merge_rejects_missing_and_bad_reports(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["merge", str(tmp_path)]) == 1
    assert "no rank reports" in capsys.readouterr().err
    (tmp_path / "npu_pool_rank0.json").write_text("{not json")
    assert main(["merge", str(tmp_path)]) == 1
    assert "npu_pool_rank0.json: not a readable npu_pool rank report" in capsys.readouterr().err
    assert main(["merge", str(tmp_path / "absent")]) == 1
    assert "not a directory" in capsys.readouterr().err


def test_merge_table_reports_device_imbalance(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Device-mode reports (as a GPU/NPU run writes them): the rank with the highest peak is named."""
    from npu_pool.recorder import report

    GiB = 1 << 30
    for rank, peak in enumerate((10 * GiB, 13 * GiB, 11 * GiB)):
        mem = {"allocated_bytes": peak // 2, "reserved_bytes": peak, "peak_allocated_bytes": peak * 9 // 10,
               "peak_reserved_bytes": peak, "utilization": 0.9,
               "pools": {"long": {"allocated_bytes": GiB, "reserved_bytes": 2 * GiB},
                         "short": {"allocated_bytes": GiB, "reserved_bytes": peak - 2 * GiB}},
               "device_mallocs": 3 + rank, "device_frees": 0, "ooms": 0, "retries": 0, "trims": 0}
        rep = {"version": report.VERSION, "rank": rank, "world_size": 4, "mode": "device", "iterations": 5,
               "step_seconds": {"mean": 1.0 + rank / 10}, "host_peak_rss_bytes": GiB, "memory": mem}
        (tmp_path / f"npu_pool_rank{rank}.json").write_text(json.dumps(rep))
    assert main(["merge", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "peak reserved   max 13.00 GiB on rank 1, min 10.00 GiB on rank 0, spread 26.5%" in out
    assert "warning: 3 reports for a world of 4 ranks (missing: [3])" in out
    row1 = next(ln.split() for ln in out.splitlines() if ln.split()[:2] == ["1", "device"])
    assert row1[4:10] == ["11.70", "13.00", "90.0%", "2.00", "11.00", "4"]
