"""``mindspeed_patch`` against the real Megatron-LM (core_r0.16.0) and MindSpeed sources in
``../shared/clients``, driven by tests/megatron_real.py in subprocesses (each starts clean:
the real ``megatron.training`` and MindSpeed's patch manager change module state for good).

What the real code does on this CPU-only machine, and where it stops, is said in
tests/megatron_real.py and docs/recorder.md."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT, SHARED, unavailable
from npu_pool.cli import main

DRIVER = ROOT / "tests" / "megatron_real.py"
MEGATRON_LM = SHARED / "clients" / "megatron-lm" / "megatron" / "training" / "training.py"
MINDSPEED = SHARED / "clients" / "mindspeed" / "mindspeed" / "patch_utils.py"


@pytest.fixture(scope="module")
def real_megatron() -> None:
    if not MEGATRON_LM.is_file():
        unavailable("../shared/clients/megatron-lm is absent (fresh clone)")
    missing = [m for m in ("einops", "regex", "six", "pydantic", "megatron.core") if not _importable(m)]
    if missing:
        unavailable(f"the real megatron.training needs {', '.join(missing)} (`./run test` installs them)")


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMORY_FRAGMENTATION", "NPU_POOL_"))}
    env.update(MEMORY_FRAGMENTATION="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", NPU_POOL_SHARED=str(SHARED))
    env.update(extra)
    return env


def _run(*args: str, timeout: int = 240, **env: str) -> tuple[dict[str, Any], str]:
    r = subprocess.run([sys.executable, str(DRIVER), *args], env=_env(**env), capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), r.stdout + r.stderr


@pytest.mark.parametrize("order", ["patch-first", "megatron-first"])
def test_real_training_functions_are_wrapped_in_either_import_order(real_megatron: None, order: str) -> None:
    out, _ = _run("wrapped", order)
    assert out["file"].startswith(str(SHARED))  # the real Megatron-LM, not a stand-in
    assert out["training"] == {"setup_model_and_optimizer": True, "train_step": True, "evaluate": True}
    assert out["schedules"] == {"forward_step": True, "backward_step": True} and out["rebound"]


def _micro(m: int, layers: int = 2) -> list[list[Any]]:
    fwd = [[n, i] for i in range(layers) for n in ("layer_enter", "layer_exit")]
    bwd = [[n, i] for i in reversed(range(layers)) for n in ("layer_enter", "layer_exit")]
    return [["forward_begin", m], *fwd, ["forward_end", m], ["backward_begin", m], *bwd, ["backward_end", m]]


def test_real_train_step_marks_megatrons_iterations_and_micro_batches(real_megatron: None, tmp_path: Path) -> None:
    """The real train_step, resumed at iteration 5, two micro-batches through the real
    schedules.forward_step/backward_step; the second optimizer step is skipped (overflow): its
    optimizer_end says so (OPTIMIZER_SKIPPED: the pool takes the next step as the states' one)."""
    from npu_pool.vocab import OPTIMIZER_SKIPPED

    out, text = _run("train", "5", "3", "2", "1", NPU_POOL_REPORT_DIR=str(tmp_path), NPU_POOL_LOG_EVERY="1")
    marks = out["marks"]
    for it in (5, 6, 7):  # Megatron's own numbers, not this process's count
        step = marks[marks.index(["iter_begin", it]):marks.index(["iter_end", it]) + 1]
        end = OPTIMIZER_SKIPPED if it == 6 else it
        assert step == [["iter_begin", it], *_micro(0), *_micro(1), ["optimizer_begin", it], ["optimizer_end", end],
                        ["iter_end", it]]
    assert out["skipped"] == [0, 1, 0] and all(loss > 0 for loss in out["losses"])
    assert out["report"] == {"iterations": 3, "last_iteration": 7, "skipped_iterations": 1, "mode": "recorder"}
    assert [ln.split(" | ")[0] for ln in text.splitlines() if ln.startswith("[npu_pool rank 0]")] == \
        [f"[npu_pool rank 0] iter {i}" for i in (6, 7, 8)]
    rep = json.loads((tmp_path / "npu_pool_rank0.json").read_text())
    assert (rep["last_iteration"], rep["skipped_iterations"], rep["iterations"]) == (7, 1, 3)


def test_real_setup_model_and_optimizer_is_marked_until_it_needs_cuda(real_megatron: None) -> None:
    out, _ = _run("setup")
    assert out["marks"] == [["setup_begin", -1], ["setup_end", -1]]  # the phase closes when the call fails
    assert out["error"]["message"] == "Torch not compiled with CUDA enabled"
    assert out["error"]["stops_in"][-1] == "training.py:get_model"  # model_module.cuda(...)


@pytest.mark.parametrize("order", ["patch-first", "mindspeed-first"])
def test_mindspeed_patch_manager_keeps_our_wrapper_around_its_replacement(real_megatron: None, order: str) -> None:
    if not MINDSPEED.is_file():
        unavailable("../shared/clients/mindspeed is absent (fresh clone)")
    out, _ = _run("mindspeed", order)
    # MindSpeed's replacement and its wrapper run, and so does ours: markers and iteration count
    assert out["calls"] == ["mindspeed wrapper", "replacement"] * 2
    assert out["marks"] == [["iter_begin", 4], ["iter_end", 4], ["iter_begin", 5], ["iter_end", 5]]
    assert out["iterations"] == 2 and "npu_pool_train_step_wrapper" in out["wrappers"]


def test_torchrun_two_ranks_over_the_real_train_step(real_megatron: None, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    """``torchrun --nproc-per-node 2`` (gloo): the real train_step on each rank, losses reduced
    across ranks, each rank's line and report, ``npu-pool merge`` over the reports."""
    reports, iters = tmp_path / "reports", 3
    out_dir = tmp_path / "results"
    out_dir.mkdir()
    env = _env(NPU_POOL_REPORT_DIR=str(reports), NPU_POOL_LOG_EVERY="1", MEGATRON_REAL_RESULTS=str(out_dir))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(DRIVER),
           "train", "0", str(iters), "2"]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = sorted((json.loads(p.read_text()) for p in out_dir.glob("rank*.json")), key=lambda x: x["rank"])
    assert [x["rank"] for x in results] == [0, 1]
    for x in results:
        assert x["report"]["iterations"] == iters
        assert x["marks"].count(["optimizer_begin", 0]) == 1
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith(f"[npu_pool rank {x['rank']}] iter ")]
        assert [ln.split(" | ")[0] for ln in lines] == [f"[npu_pool rank {x['rank']}] iter {i}"
                                                       for i in range(1, iters + 1)]
    assert results[0]["losses"] == results[1]["losses"]  # train_step averaged the loss across the ranks
    files = sorted(p.name for p in reports.iterdir())
    assert files == ["npu_pool_rank0.json", "npu_pool_rank1.json"]
    for rank, f in enumerate(files):
        rep = json.loads((reports / f).read_text())
        assert (rep["rank"], rep["world_size"], rep["iterations"], rep["mode"]) == (rank, 2, iters, "recorder")
        assert {"forward", "backward", "optimizer"} <= set(rep["phase_seconds"])
    capsys.readouterr()
    assert main(["merge", str(reports)]) == 0
    out = capsys.readouterr().out
    assert [ln.split()[:3] for ln in out.splitlines()[2:4]] == [["0", "recorder", str(iters)],
                                                               ["1", "recorder", str(iters)]]
    assert "imbalance across ranks" in out
