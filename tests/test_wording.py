"""Messages a newcomer tripped on (issue 23), as they read now: each says what it means."""
from __future__ import annotations

from pathlib import Path

import pytest

from npu_pool.cli import main
from npu_pool.planner import PlanError, make_plan, save_plan
from npu_pool.pool import OutOfMemoryError, Pool
from npu_pool.trace.format import OP_ALLOC, OP_FREE, Trace
from test_planner import training

MiB = 1 << 20


def test_oom_message_says_the_small_request_needs_a_whole_segment() -> None:
    """torch's policy serves a 3 MiB request from a new 20 MiB segment: the message says the
    request needs 20 MiB in one piece after rounding, not "a request of 20 MiB"."""
    with Pool("torch", capacity=30 * MiB) as p:
        held = p.malloc(18 * MiB)
        with pytest.raises(OutOfMemoryError) as e:
            p.malloc(3 * MiB)
        p.free(held)
    msg = str(e.value)
    assert "tried to allocate 3.00 MiB" in msg and "a request of 20.00 MiB" not in msg
    assert "the request needs 20.00 MiB in one piece (rounded up to what the policy takes from the device" in msg


def test_plan_mismatch_names_the_plan_file_and_what_never_runs(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    save_plan(make_plan(training(iters=3), "train.npt"), tmp_path / "p.npplan")
    other = Trace(meta={"n_ids": 4, "sites": ["m.py:1:f"], "origin": "npu_pool.capture:llama"})
    for i in range(4):
        other.append(OP_ALLOC, id=i, size=MiB, site=0)
    for i in range(4):
        other.append(OP_FREE, id=i, size=MiB, site=0)
    other.save(tmp_path / "other.npt")
    rc = main(["replay", str(tmp_path / "other.npt"), "--policy", "planned", "--plan", str(tmp_path / "p.npplan"),
               "--no-min-capacity"])
    err = capsys.readouterr().err
    assert rc == 1
    assert f"the plan {tmp_path / 'p.npplan'} was made for train.npt: its training iteration" in err
    assert "never runs in other. Make a plan" in err and "npu_pool.capture:llama" not in err  # the file, not its origin
    assert "Make a plan from this trace itself: `npu-pool plan TRACE --out PLAN`" in err
    from npu_pool import replay

    del other.meta["origin"]
    with pytest.raises(PlanError, match="never runs in the replayed trace"):
        replay.run(other, "planned", plan=tmp_path / "p.npplan")


def test_replay_help_names_its_default_policies(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "default: torch,expandable,npu_pool; add planned" in out and "default: all" not in out


def test_cli_help_describes_the_demos_7b_case(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "a Llama-7B training step (fake tensors) on a simulated 64 GiB device" in out


def test_estimate_warns_when_the_trace_is_another_model(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    t = training(iters=2)
    t.save(tmp_path / "tiny.npt")
    cfg = tmp_path / "7b.yaml"
    cfg.write_text("hidden: 4096\nlayers: 32\nheads: 32\nvocab: 32000\nseq: 4096\nmicro_batch: 1\n")
    assert main(["estimate", "--config", str(cfg), "--trace", str(tmp_path / "tiny.npt")]) == 0
    err = capsys.readouterr().err
    assert "warning: the trace's peak live bytes are" in err and "x the estimate" in err
    assert "leave out --config" in err


def test_capture_says_one_micro_batch_and_what_host_scalars_are(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    assert main(["capture", "--shape", "7b", "--tp", "2", "--layers", "1", "--steps", "2", "--no-progress",
                 "--out", str(tmp_path / "t.npt")]) == 0
    out = capsys.readouterr().out
    assert "2 steps x 1 micro-batch of " in out and "micro-batches" not in out
    assert "host scalars left out" not in out
    assert "host scalars: 0-dim CPU tensors" in out and "--keep-host-scalars keeps them" in out


def test_the_readmes_demo_transcript_is_what_the_demo_prints_now() -> None:
    """docs/img/demo_terminal.txt (and the screenshot of its first screen) showed a 7B table two
    arena changes old; `python benchmarks/demo_screenshot.py` writes both. The 7B part is
    deterministic (the CPU captures' timings are not, so they are left out here)."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "npu_pool.cli", "demo", "--no-capture"], cwd=root, text=True,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0, r.stdout[-2000:]

    def seven_b(text: str) -> list[str]:
        lines = text.splitlines()
        return lines[:next(i for i, line in enumerate(lines) if line.startswith("made offline")) + 1]

    saved = seven_b((root / "docs" / "img" / "demo_terminal.txt").read_text())
    assert seven_b(r.stdout) == saved, "rerun python benchmarks/demo_screenshot.py"


def test_version_and_validate_of_an_npu_pool_export(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`npu-pool --version` exists; --validate refusing a snapshot npu_pool exported named it
    'recorded with expandable segments'."""
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("npu-pool ")
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "npu_pool", "--version"], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0 and r.stdout.startswith("npu-pool "), r.stderr[-500:]  # (no __main__ before)
    t = Trace(meta={"n_ids": 1, "expandable_segments": True, "allocator_settings": {"npu_pool_policy": "npu_pool"}})
    t.append(OP_ALLOC, id=0, size=MiB)
    t.append(OP_FREE, id=0, size=MiB)
    t.save(tmp_path / "t.npt")
    assert main(["replay", str(tmp_path / "t.npt"), "--validate"]) == 1
    out = capsys.readouterr().out
    assert "recorded with npu_pool's 'npu_pool' policy" in out and "expandable" not in out


def test_estimate_says_one_range_for_a_field_and_names_the_wrong_one(capsys: pytest.CaptureFixture) -> None:
    """--hidden -5 said '0..', then --hidden 0 'a positive integer'; --norm foo and --position foo
    both said 'norm must be ...; position ...'."""
    base = ["estimate", "--layers", "2", "--heads", "2", "--vocab", "10"]
    for hidden in ("-5", "0"):  # (a bad value on the command line: a usage error, exit 2)
        assert main([*base, "--hidden", hidden]) == 2
        assert f"hidden must be a whole number in 1..1099511627775, not {hidden}" in capsys.readouterr().err
    assert main([*base, "--hidden", "8", "--norm", "foo"]) == 2
    assert "norm must be layernorm or rmsnorm, not 'foo'" in capsys.readouterr().err
    assert main([*base, "--hidden", "8", "--position", "foo"]) == 2
    assert "position must be learned or rope, not 'foo'" in capsys.readouterr().err
