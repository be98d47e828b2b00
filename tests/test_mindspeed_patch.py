"""mindspeed_patch.megatron: patching Megatron's training functions, the per-iteration line,
rank reports, the CPU fallback and bad settings.

Small modules with Megatron's function names test the patch's own rules here; the real
Megatron-LM and MindSpeed are driven in tests/test_megatron_real.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
import warnings
from pathlib import Path
from typing import Any, Iterator

import pytest

from mindspeed_patch import megatron as patch
import importlib

install_mod = importlib.import_module("npu_pool.install")
from npu_pool.config import ConfigError
from npu_pool.pool import Pool
from npu_pool.recorder import default
from npu_pool.trace.format import MARK_NAMES

ROOT = Path(__file__).resolve().parents[1]
ON = {"MEMORY_FRAGMENTATION": "1"}
needs_mcore = pytest.mark.usefixtures("megatron_core")
pytestmark = pytest.mark.filterwarnings("ignore:.*(Transformer Engine|Apex|deprecated|tp_group|ffn_hidden_size|"
                                        "full scope).*")


@pytest.fixture
def fresh() -> Iterator[None]:
    """No patch session, no Megatron training module imported, before and after."""
    def clear() -> None:
        patch._unpatch()
        for name in [n for n in sys.modules if n == "megatron.training" or n.startswith("megatron.training.")]:
            del sys.modules[name]
        sys.modules.pop("fake_mindspeed_llm", None)

    clear()
    yield
    clear()


def _module(**funcs: Any) -> types.ModuleType:
    """A stand-in ``megatron.training.training`` with the given functions, already imported."""
    mod = types.ModuleType(patch.TARGET)
    for name, fn in funcs.items():
        setattr(mod, name, fn)
    sys.modules[patch.TARGET] = mod
    return mod


# -- settings ------------------------------------------------------------------------------
def test_switch_off_patches_nothing(fresh: None) -> None:
    mod = _module(train_step=lambda: 1)
    original = mod.train_step
    assert patch.patch_megatron({}) is False
    assert patch.patch_megatron({"MEMORY_FRAGMENTATION": "0"}) is False
    assert mod.train_step is original and patch.session() is None


def test_switch_off_reads_none_of_the_pools_other_settings(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """An A/B run flips MEMORY_FRAGMENTATION alone: with it at 0 a setting left for the pool's runs,
    even a bad one, is not read (before: importing mindspeed_patch raised on it)."""
    import mindspeed_patch

    stale = {"MEMORY_FRAGMENTATION": "0", "NPU_POOL_FRACTION": "garbage", "NPU_POOL_POLICY": "bogus",
             "NPU_POOL_LOG_EVERY": "x"}
    for k, v in stale.items():
        monkeypatch.setenv(k, v)
    assert patch.patch_megatron(stale) is False and patch.session() is None
    assert mindspeed_patch.install_memory_pool() is False
    monkeypatch.setenv("MEMORY_FRAGMENTATION", "1")
    with pytest.raises(ConfigError, match="NPU_POOL_FRACTION='garbage' is not valid"):
        mindspeed_patch.install_memory_pool()


def test_a_bad_megatron_setting_is_refused_before_the_pool_is_installed(fresh: None,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """All or nothing: NPU_POOL_LOG_EVERY and NPU_POOL_REPORT_DIR are checked before install()
    swaps torch's allocator (before: the import raised with the pool already installed)."""
    import mindspeed_patch

    calls: list[Any] = []
    monkeypatch.setattr(install_mod, "install", lambda **kw: calls.append(kw))
    for k, v in {**ON, "NPU_POOL_LOG_EVERY": "-5"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match="NPU_POOL_LOG_EVERY='-5'"):
        mindspeed_patch.install_memory_pool()
    assert calls == []
    monkeypatch.setenv("NPU_POOL_LOG_EVERY", "5")
    assert mindspeed_patch.install_memory_pool() is True and len(calls) == 1


@pytest.mark.parametrize("bad", ["abc", "-1", "1.5", "ten", "0x10"])
def test_bad_log_every_is_rejected_naming_the_variable(fresh: None, bad: str) -> None:
    with pytest.raises(ConfigError, match=f"NPU_POOL_LOG_EVERY={bad!r} is not valid: use a whole number"):
        patch.patch_megatron({**ON, "NPU_POOL_LOG_EVERY": bad})
    assert patch.session() is None


def test_a_report_dir_that_is_a_file_is_refused_when_patching(fresh: None, tmp_path: Path) -> None:
    """Said at the start, not at exit when the report is due (before: the run finished, then the
    report was lost with 'File exists')."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ConfigError, match="NPU_POOL_REPORT_DIR=.*afile.* is not a directory"):
        patch.patch_megatron({**ON, "NPU_POOL_REPORT_DIR": str(afile)})
    assert patch.session() is None


def test_a_forked_child_that_exits_leaves_the_ranks_report_alone(tmp_path: Path) -> None:
    """The report is written at exit: a helper process forked by the training script (not a
    multiprocessing worker, which leaves by os._exit) exited normally and rewrote the rank's
    report with the figures it inherited (5 iterations where the rank ran 10)."""
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent("""
        import os, sys, types
        mod = types.ModuleType("megatron.training.training")
        mod.train_step = lambda *a, **k: ("loss", 0)
        sys.modules["megatron.training.training"] = mod
        import mindspeed_patch
        for _ in range(5):
            mod.train_step()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.read(r, 1)  # until the parent has run 5 more steps and written its report
            sys.exit(0)    # a normal exit: atexit handlers run
        for _ in range(5):
            mod.train_step()
        from mindspeed_patch.megatron import write_report
        path = write_report()
        os.write(w, b"x")
        os.waitpid(pid, 0)
        import json
        print(json.load(open(path))["iterations"])  # (before this process's own exit writes it again)
        """))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(ON, PYTHONPATH=str(ROOT), NPU_POOL_REPORT_DIR=str(tmp_path / "rep"), NPU_POOL_LOG_EVERY="0")
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["10"], r.stdout


_TRAINER = """
import os, sys, time, types
mod = types.ModuleType("megatron.training.training")
mod.train_step = lambda *a, **k: ("loss", 0)
sys.modules["megatron.training.training"] = mod
import mindspeed_patch
"""


def _env(tmp_path: Path, report_dir: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(ON, PYTHONPATH=str(ROOT), NPU_POOL_REPORT_DIR=report_dir, NPU_POOL_LOG_EVERY="0")
    return env


def test_a_process_that_never_trained_leaves_the_ranks_report_alone(tmp_path: Path) -> None:
    """Every process that imports torch with the switch on runs the patch: the parent of
    spawned ranks (torch.multiprocessing.spawn), a launcher, a DataLoader worker started with
    spawn. Such a process exited after the rank it started and wrote an empty report under the
    rank's name (no RANK: rank 0), replacing the rank's (iterations 0)."""
    rank = tmp_path / "rank.py"
    rank.write_text(_TRAINER + "for _ in range(3):\n    mod.train_step()\n")
    parent = tmp_path / "parent.py"
    parent.write_text(_TRAINER + f"import subprocess\nsubprocess.run([sys.executable, {str(rank)!r}], check=True)\n")
    env = _env(tmp_path, str(tmp_path / "rep"))
    r = subprocess.run([sys.executable, str(parent)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    (report,) = (tmp_path / "rep").glob("npu_pool_rank*.json")
    assert json.loads(report.read_text())["iterations"] == 3
    # nor one that wrote a report itself before starting the rank (a review: its exit rewrote it)
    parent.write_text(_TRAINER + "from mindspeed_patch.megatron import write_report\nwrite_report()\n"
                      f"import subprocess\nsubprocess.run([sys.executable, {str(rank)!r}], check=True)\n")
    r = subprocess.run([sys.executable, str(parent)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(report.read_text())["iterations"] == 3


def test_a_rank_ended_by_a_signal_leaves_its_report(tmp_path: Path) -> None:
    """torchrun stops the ranks that outlive a failed one with SIGTERM (a scheduler's time limit
    too; the kernel's out-of-memory killer with SIGKILL), whose default action runs no exit
    handler: the surviving ranks' reports were lost. The report is written during training (after
    the first step, then every REPORT_EVERY_S seconds; 0 here: every step), and the signal still
    ends the process at once (a handler would wait for a rank blocked in a collective)."""
    import signal

    script = tmp_path / "s.py"
    script.write_text(_TRAINER + "import signal\nmindspeed_patch.megatron.REPORT_EVERY_S = 0\nfor _ in range(4):\n"
                      "    mod.train_step()\nprint('ready', signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "
                      "flush=True)\ntime.sleep(60)\n")
    env = _env(tmp_path, str(tmp_path / "rep"))
    p = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:  # (no SIGTERM handler: a handler waits for a rank blocked in C; SIGKILL runs none either way)
        assert p.stdout.readline().strip() == "ready True", p.stderr.read()[-2000:]
        p.send_signal(signal.SIGKILL)
        assert p.wait(timeout=60) == -signal.SIGKILL
    finally:
        p.kill()
        p.communicate()
    report = json.loads((tmp_path / "rep" / "npu_pool_rank0.json").read_text())
    assert report["iterations"] == 4 and report["final"] is False  # (written in training: merge warns of it)


def test_ranks_forked_from_the_patched_process_write_their_own_reports(tmp_path: Path) -> None:
    """Ranks started with multiprocessing's fork inherit the parent's session: the exit rule (a
    forked child's exit is not its report) kept them from writing at exit, so a rank's report was
    the one written after its first step (a review). A forked process that trains makes the
    session its own."""
    script = tmp_path / "s.py"
    script.write_text(_TRAINER + textwrap.dedent("""
        import multiprocessing as mp

        def rank(r):
            os.environ["RANK"], os.environ["WORLD_SIZE"] = str(r), "3"
            from npu_pool.recorder import default  # (the patch's recorder)

            with default.phase("setup"):  # the rank's own set-up
                time.sleep(0.05)
            for _ in range(4 + r):
                mod.train_step()

        if __name__ == "__main__":
            os.environ["RANK"], os.environ["WORLD_SIZE"] = "2", "3"
            for _ in range(3):  # the parent trains first: its markers are its own report's
                mod.train_step()
            procs = [mp.get_context("fork").Process(target=rank, args=(r,)) for r in (0, 1)]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
                assert p.exitcode == 0
        """))
    r = subprocess.run([sys.executable, str(script)], env=_env(tmp_path, str(tmp_path / "rep")), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    reports = {json.loads(f.read_text())["rank"]: json.loads(f.read_text()) for f in (tmp_path / "rep").glob("*.json")}
    assert {k: v["iterations"] for k, v in reports.items()} == {0: 4, 1: 5, 2: 3}
    assert all(v["final"] for v in reports.values())  # each written as its process exited
    assert len({v["pid"] for v in reports.values()}) == 3
    # the recorder's markers too: a rank's are its own set-up's and steps' (they held the parent's three
    # steps' before; and a reset at the first step lost the rank's set-up)
    per_step = reports[1]["marks"] - reports[0]["marks"]
    assert per_step > 0 and {k: v["marks"] for k, v in reports.items()} == {0: 2 + 4 * per_step, 1: 2 + 5 * per_step,
                                                                              2: 3 * per_step}
    assert all(reports[r]["phase_seconds"]["setup"] >= 0.05 for r in (0, 1)) and "setup" not in reports[2]["phase_seconds"]


def test_a_child_forked_inside_a_step_that_leaves_through_it_writes_nothing(tmp_path: Path) -> None:
    """A helper forked inside train_step that ends by sys.exit passes through the wrapper's
    finally: it counted a step and wrote the rank's report as its own (a review)."""
    script = tmp_path / "s.py"
    script.write_text(_TRAINER.replace('mod.train_step = lambda *a, **k: ("loss", 0)', textwrap.dedent("""
        import json
        writers = set()
        def step(*a, **k):
            if os.fork() == 0:
                sys.exit(0)  # a helper's normal end, from inside the step
            os.wait()
            path = os.path.join(os.environ["NPU_POOL_REPORT_DIR"], "npu_pool_rank0.json")
            if os.path.exists(path):  # (who wrote the report last, the helper included)
                writers.add(json.load(open(path))["pid"])
            return ("loss", 0)
        mod.train_step = step""")) + "mindspeed_patch.megatron.REPORT_EVERY_S = 0\nfor _ in range(3):\n    mod.train_step()\n"
                      "print(json.dumps(dict(json.load(open(mindspeed_patch.megatron.write_report())), "
                      "writers=sorted(writers))))\n")
    r = subprocess.run([sys.executable, str(script)], env=_env(tmp_path, str(tmp_path / "rep")), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout.splitlines()[-1])
    assert report["iterations"] == 3 and report["writers"] == [report["pid"]]


def test_reports_during_training_are_paced(fresh: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The report is written after the first step, then once REPORT_EVERY_S seconds have passed:
    not at every step (ranks share a file system)."""
    clock = [100.0]
    monkeypatch.setattr(patch.time, "perf_counter", lambda: clock[0])
    writes: list[int] = []
    mod = _module(train_step=lambda: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        patch.patch_megatron({**ON, "NPU_POOL_REPORT_DIR": str(tmp_path), "NPU_POOL_LOG_EVERY": "0"})
    session = patch.session()
    monkeypatch.setattr(session, "write_report", lambda: writes.append(session.iterations))
    for _ in range(3):
        mod.train_step()
    clock[0] += patch.REPORT_EVERY_S
    mod.train_step()
    mod.train_step()
    assert writes == [1, 4]


def test_a_relative_report_dir_is_where_the_run_started(tmp_path: Path) -> None:
    """NPU_POOL_REPORT_DIR=rep was checked against the starting directory and resolved again at
    exit: a run that changed directory wrote its report somewhere else."""
    script = tmp_path / "s.py"
    (tmp_path / "elsewhere").mkdir()
    script.write_text(_TRAINER + "os.chdir('elsewhere')\nmod.train_step()\n")
    r = subprocess.run([sys.executable, str(script)], env=_env(tmp_path, "rep"), cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "rep" / "npu_pool_rank0.json").is_file() and not (tmp_path / "elsewhere" / "rep").exists()


def test_cpu_process_falls_back_with_a_clear_message(tmp_path: Path) -> None:
    """The switch set where there is no torch_npu and no CUDA: importing mindspeed_patch says
    why nothing was installed, the Megatron patch says it records phases only, and the run
    goes on and writes its report."""
    script = tmp_path / "s.py"
    script.write_text("import mindspeed_patch\nfrom mindspeed_patch.megatron import patch_megatron, write_report\n"
                      "assert patch_megatron()\nprint(write_report())\n")
    env = {**os.environ, **ON, "NPU_POOL_REPORT_DIR": str(tmp_path / "rep"), "PYTHONPATH": str(ROOT)}
    env.pop("NPU_POOL_LOG_EVERY", None)
    r = subprocess.run([sys.executable, "-W", "default", str(script)], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "MEMORY_FRAGMENTATION=1, but npu_pool was not installed" in r.stderr
    assert "torch_npu is not installed" in r.stderr and "CPU-only build" in r.stderr
    assert "no device allocator is installed" in r.stderr and "recording phase markers and step times only" in r.stderr
    report = json.loads(Path(r.stdout.strip()).read_text())
    assert report["mode"] == "recorder" and report["memory"] is None and report["rank"] == 0
    # written by the user: final (the process ran no step, so no exit handler writes it again; merge
    # said it was killed); and a launcher that writes one and exits after its ranks leaves theirs alone
    assert report["final"] is True


# -- patching ------------------------------------------------------------------------------
def test_already_imported_module_is_patched_and_rebound_elsewhere(fresh: None, capsys: pytest.CaptureFixture) -> None:
    calls: list[str] = []

    def setup_model_and_optimizer(provider: Any, model_type: Any = None) -> tuple:
        calls.append("setup")
        return [provider()], None, None

    def train_step(*args: Any, **kwargs: Any) -> tuple:
        calls.append("step")
        return {}, False, False, False, 0, 1.0, 0

    def evaluate(*args: Any, **kwargs: Any) -> tuple:
        calls.append("eval")
        assert default.state.is_open("eval")
        return {}, None, False

    mod = _module(setup_model_and_optimizer=setup_model_and_optimizer, train_step=train_step, evaluate=evaluate)
    llm = types.ModuleType("fake_mindspeed_llm")  # MindSpeed-LLM binds Megatron's functions by name
    llm.train_step = train_step
    sys.modules["fake_mindspeed_llm"] = llm
    seen: list[tuple[int, int]] = []
    stop = default.listen(lambda c, a: seen.append((c, a)))
    try:
        assert patch.patch_megatron({**ON, "NPU_POOL_LOG_EVERY": "2"})
        assert patch.patch_megatron({**ON, "NPU_POOL_LOG_EVERY": "2"})  # idempotent
        assert llm.train_step is mod.train_step is not train_step
        import torch

        with pytest.warns(RuntimeWarning, match="no TransformerBlock"):
            mod.setup_model_and_optimizer(lambda: torch.nn.Linear(2, 2))
        for _ in range(3):
            llm.train_step()
        mod.evaluate()
    finally:
        stop()
    assert calls == ["setup", "step", "step", "step", "eval"]
    seq = [MARK_NAMES[c] for c, _ in seen]
    assert seq[:2] == ["setup_begin", "setup_end"] and seq.count("iter_begin") == 3 and seq[-2:] == ["eval_begin",
                                                                                                       "eval_end"]
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[0] for line in out] == ["[npu_pool rank 0] iter 2"]  # every 2nd iteration
    assert patch.session().patched[patch.TARGET] == list(patch.FUNCTIONS)


def test_missing_functions_warn_once_each_and_do_not_crash(fresh: None) -> None:
    _module(train_step=lambda: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert patch.patch_megatron(ON)
    msgs = [str(w.message) for w in caught if "not found" in str(w.message)]
    assert len(msgs) == 2
    assert any("megatron.training.training.setup_model_and_optimizer not found" in m for m in msgs)
    assert any("megatron.training.training.evaluate not found" in m for m in msgs)
    assert patch.session().patched[patch.TARGET] == ["train_step"]
    sys.modules[patch.TARGET].train_step()
    assert patch.session().iterations == 1


def test_step_times_are_summarised_in_constant_memory(fresh: None) -> None:
    """A long run's report gives the mean, max and last step time; the session keeps those, not
    every step (32 bytes a step grew without bound over a million-iteration run)."""
    _module(train_step=lambda: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (recorder mode: no installed pool)
        assert patch.patch_megatron(ON)
    s = patch.session()
    for seconds in (0.5, 2.0, 1.0) * 1000:
        s.after_step(seconds)
    assert s.iterations == 3000 and s.step_times.count == 3000
    got = s.report()["step_seconds"]
    assert got == {"mean": pytest.approx(3.5 / 3), "max": 2.0, "last": 1.0}
    assert sys.getsizeof(s.step_times) < 100 and not hasattr(s.step_times, "__dict__")


def test_device_mode_line_and_report_show_the_pool(fresh: None, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    """With an installed pool (here a simulated one standing for the device's) the line and
    the report carry its figures."""
    sim = Pool("npu_pool", capacity=1 << 32)
    monkeypatch.setattr(install_mod, "installed", lambda: {0: sim})
    monkeypatch.setattr(install_mod, "current_pool", lambda start=True: sim)
    held: list[int] = []

    def train_step() -> None:
        held.append(sim.malloc(3 << 20, lifetime="long"))
        sim.free(sim.malloc(5 << 20, lifetime="short"))

    mod = _module(train_step=train_step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        patch.patch_megatron({**ON, "NPU_POOL_REPORT_DIR": str(tmp_path)})
    mod.train_step()
    mod.train_step()
    st = sim.stats()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[1].startswith("[npu_pool rank 0] iter 2 | step ")
    gib = lambda b: f"{b / (1 << 30):.2f}"  # noqa: E731
    assert f"allocated {gib(st['total']['allocated']['current'])} GiB" in lines[1]
    assert f"peak {gib(st['total']['reserved']['peak'])} GiB" in lines[1]
    assert f"device mallocs {st['device_mallocs']}" in lines[1] and "long " in lines[1] and "short " in lines[1]
    report = json.loads(Path(patch.write_report()).read_text())
    mem = report["memory"]
    assert report["mode"] == "device" and report["iterations"] == 2 and report["policy"] == "npu_pool"
    assert mem["allocated_bytes"] == st["total"]["allocated"]["current"] == 2 * (3 << 20)
    assert mem["peak_reserved_bytes"] == st["total"]["reserved"]["peak"]
    assert mem["utilization"] == pytest.approx(st["total"]["allocated"]["peak"] / st["total"]["reserved"]["peak"])
    assert mem["pools"]["long"]["allocated_bytes"] == 2 * (3 << 20) and mem["pools"]["short"]["allocated_bytes"] == 0


def test_a_mindspeed_manager_that_refuses_the_wrapper_falls_back_to_direct_wrapping(
        fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    class Refusing:
        patches_info: dict = {}

        @staticmethod
        def register_patch(name: str, fn: Any) -> None:
            raise RuntimeError("the patch of train_step exist !")

    monkeypatch.setattr(patch, "_mindspeed_manager", lambda: Refusing)
    mod = _module(train_step=lambda *a, **k: ({}, 0), evaluate=lambda: None,
                  setup_model_and_optimizer=lambda: None)
    with pytest.warns(RuntimeWarning, match="refused the wrapper of megatron.training.training.train_step"):
        assert patch.patch_megatron(ON)
    assert getattr(mod.train_step, patch._WRAPPED)
    seen: list[tuple[int, int]] = []
    stop = default.listen(lambda c, a: seen.append((c, a)))
    try:
        mod.train_step(iteration=7)
    finally:
        stop()
    assert [(MARK_NAMES[c], a) for c, a in seen] == [("iter_begin", 7), ("iter_end", 7)]


def test_the_line_never_stops_training_and_reports_keep_the_runs_rank(tmp_path: Path) -> None:
    """From a hostile review: with stdout closed (`>&-`) or a broken pipe the per-iteration line
    raised AttributeError / BrokenPipeError into train_step (hiding the step's own exception);
    a process group destroyed before exit (as torch asks) made every rank write
    npu_pool_rank0.json; RANK >= WORLD_SIZE wrote a report merge refuses."""
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent("""
        import os, sys, types
        mod = types.ModuleType("megatron.training.training")  # (before torch: the start-up hook patches then)
        mod.train_step = lambda *a, **k: ("loss", 0)
        sys.modules["megatron.training.training"] = mod
        import torch.distributed as dist
        rank = int(sys.argv[1])
        if rank >= 0:
            dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
        import mindspeed_patch
        for _ in range(3):
            mod.train_step()
        if rank >= 0:
            dist.destroy_process_group()
        """))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(ON, PYTHONPATH=str(ROOT), NPU_POOL_REPORT_DIR=str(tmp_path / "rep"))
    # stdout closed: training goes on, one warning says the line stopped
    r = subprocess.run(f"{sys.executable} {script} -1 x >&-", shell=True, env=env, capture_output=False,
                       stderr=subprocess.PIPE, text=True, timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("the per-iteration line could not be written") == 1, r.stderr
    # two ranks, no RANK in the environment, the group destroyed before exit: two reports
    rdv = tmp_path / "rdv"
    procs = [subprocess.Popen([sys.executable, str(script), str(k), str(rdv)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for k in (0, 1)]
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read()
    reports = sorted(p.name for p in (tmp_path / "rep").iterdir())
    assert reports == ["npu_pool_rank0.json", "npu_pool_rank1.json"], reports
    assert json.loads((tmp_path / "rep" / "npu_pool_rank1.json").read_text())["world_size"] == 2
    # a rank outside its world: warned, the world unknown, and merge takes the report
    for f in (tmp_path / "rep").iterdir():
        f.unlink()
    r = subprocess.run([sys.executable, str(script), "-1", "x"], env={**env, "RANK": "5", "WORLD_SIZE": "2"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "WORLD_SIZE=2 with RANK='5' is no world this rank belongs to" in r.stderr, r.stderr
    from npu_pool.cli import main

    assert main(["merge", str(tmp_path / "rep")]) == 0


def test_a_model_the_caller_attached_already_keeps_its_attachment(fresh: None) -> None:
    """A model attached by the caller before set-up returned (its model provider did): the wrapper's
    own attach is refused (it would send every marker twice); it says so and training goes on."""
    import torch

    from npu_pool.recorder import attach

    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(3)])
    own = attach(model, blocks=list(model))

    def setup_model_and_optimizer(provider: Any, model_type: Any = None) -> tuple:
        return [provider()], None, None

    mod = _module(setup_model_and_optimizer=setup_model_and_optimizer)
    try:
        assert patch.patch_megatron(ON)
        with pytest.warns(RuntimeWarning, match="already attached.*the markers come from that attachment"):
            assert mod.setup_model_and_optimizer(lambda: model)[0] == [model]
        assert patch.session().attachments == []
    finally:
        own.detach()
    # attached without its optimizer (the provider had none yet): the wrapper hooks the step into it
    own = attach(model, blocks=list(model))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mod.setup_model_and_optimizer = patch.session().setup(lambda provider: ([provider()], opt, None))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mod.setup_model_and_optimizer(lambda: model)
        assert patch.session().attachments == [own]
        seen: list[int] = []
        stop = default.listen(lambda c, a: seen.append(c))
        opt.step()
        stop()
        assert [MARK_NAMES[c] for c in seen][:1] == ["optimizer_begin"]
    finally:
        own.detach()


def test_each_backward_is_the_micro_batch_of_the_forward_it_runs_back(fresh: None) -> None:
    """The interleaved pipeline schedule runs one forward and one backward per model chunk and
    micro-batch, each chunk's backwards in its forwards' order but chunks in reverse: numbered by a
    counter, chunk 0's first backward was micro-batch 2 of 0..3 with 2 chunks of 2 micro-batches (a
    review under Megatron-LM's interleaved schedule, 2026-11-27)."""
    import torch

    _module(train_step=lambda: None)
    assert patch.patch_megatron(ON)
    s = patch.session()
    fwd = s.forward_step(lambda x, current_microbatch=None: ([x * 2], 1))
    bwd = s.backward_step(lambda input_tensor, output_tensor, grad, model_type, config: None)
    seen: list[tuple[int, int]] = []
    stop = default.listen(lambda c, a: seen.append((c, a)))
    try:
        outs = {}
        for chunk in range(2):
            for m in range(2):
                outs[chunk, m] = fwd(torch.ones(2, requires_grad=True), current_microbatch=m)[0]
        for chunk in (1, 0):
            for m in range(2):
                bwd(None, outs[chunk, m], None, None, None)
        bwd(None, torch.ones(1, requires_grad=True) * 3, None, None, None)  # no forward of ours: counted
    finally:
        stop()
    backward = [a for c, a in seen if MARK_NAMES[c] == "backward_begin"]
    assert backward == [0, 1, 0, 1, 4], seen
