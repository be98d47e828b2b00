"""Files and settings an attacker (or an accident) hands the tools: outputs torn by a full disk,
Ctrl-C, SIGTERM or a second writer; YAML bombs; files that are not what their name says;
long inputs that must stream; OOM snapshots of a long run; numbers and shapes that used to
raise tracebacks. Each ends in a whole file or none, and a one-line error."""
from __future__ import annotations

import array
import json
import os
import pickle
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from npu_pool import config, oom, outputs
from npu_pool.cli import main
from npu_pool.config import ConfigError
from npu_pool.planner import PlanError, load_plan, make_plan, save_plan
from npu_pool.pool import OutOfMemoryError, Pool
from npu_pool.trace.format import MARK_ITER_BEGIN, OP_ALLOC, OP_FREE, OP_MARK, Trace, TraceError
from npu_pool.trace.snapshot import load_snapshot
from test_hostile import small_trace
from test_planner import training
from conftest import unavailable

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def _one_line(capsys: pytest.CaptureFixture, argv: list[str], *words: str, seconds: float = 10.0,
              code: int = 1) -> str:
    """The CLI fails fast with exit 1 (``code``: 2 for a mistake in the command line itself) and one
    line on stderr naming the problem, no traceback."""
    t0 = time.perf_counter()
    assert main(argv) == code
    assert time.perf_counter() - t0 < seconds
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1 and len(err) < 600, err
    for w in words:
        assert w in err, err
    return err


def _no_partials(folder: Path) -> None:
    assert not [p for p in folder.rglob("*") if p.name.endswith(outputs.PARTIAL)]


def synthetic(n: int, seed: int = 0, live_max: int = 2000) -> Trace:
    """``n`` events of allocations (1 B .. 64 MiB) and frees, at most ``live_max`` live, 50 sites."""
    rng = random.Random(seed)
    cols = {c: array.array(code) for c, code in (("op", "B"), ("cat", "B"), ("site", "i"), ("id", "q"),
                                                    ("size", "Q"), ("stream", "q"), ("addr", "Q"))}
    live: list[tuple[int, int, int]] = []
    nid = 0
    for i in range(n):
        if i % 5000 == 0:
            row = (OP_MARK, MARK_ITER_BEGIN, -1, i // 5000, 0)
        elif live and (len(live) >= live_max or rng.random() < 0.5):
            id_, size, site = live.pop(rng.randrange(len(live)))
            row = (OP_FREE, 0, site, id_, size)
        else:
            size = rng.choice((rng.randint(1, 4096), rng.randint(4096, 2 * MiB), rng.randint(2 * MiB, 64 * MiB)))
            site = rng.randrange(50)
            row = (OP_ALLOC, 0, site, nid, size)
            live.append((nid, size, site))
            nid += 1
        for c, v in zip(("op", "cat", "site", "id", "size"), row):
            cols[c].append(v)
        cols["stream"].append(0)
        cols["addr"].append(0)
    t = Trace(meta={"origin": "synthetic", "n_ids": nid, "device": 0,
                    "sites": [f"model/layer{k}.py:{10 + k}:forward" for k in range(50)]}, **cols)
    t.validate()
    return t


# -- 1. outputs are whole or absent ------------------------------------------------------------

def _limited(argv: list[str], limit: int, cwd: Path) -> subprocess.CompletedProcess:
    """Run the CLI in a process whose files may not grow past ``limit`` bytes (RLIMIT_FSIZE: the
    kernel fails the write past it, as a full disk does)."""
    code = textwrap.dedent(f"""
        import resource, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing
        from npu_pool.cli import main
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
        sys.exit(main({argv!r}))
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(cwd), timeout=300)


def test_a_full_disk_leaves_no_file_under_any_writers_name(tmp_path: Path) -> None:
    trace = tmp_path / "t.npt"
    training(layers=2, iters=3).save(trace)
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "npu_pool_rank0.json").write_text(json.dumps({"version": 1, "rank": 0, "step_seconds": {}}))
    cfg = tmp_path / "model.yaml"
    cfg.write_text("hidden: 1024\nlayers: 4\nheads: 16\nvocab: 32000\n")
    out = tmp_path / "out"
    out.mkdir()
    old = out / "kept.html"
    old.write_text("the previous report")
    cases = {
        "export": ["export", str(trace), "--out", str(out / "x.pickle")],
        "analyze html": ["analyze", str(trace), "--format", "html", "--policy", "npu_pool", "--no-progress",
                         "--out", str(old)],
        "plan": ["plan", str(trace), "--out", str(out / "p.npplan")],
        "estimate": ["estimate", "--config", str(cfg), "--format", "json", "--out", str(out / "e.json")],
        "merge": ["merge", str(reports), "--json", str(out / "m.json")],
        "replay": ["replay", str(trace), "--policy", "npu_pool", "--no-min-capacity", "--json", str(out / "r.json")],
    }
    for name, argv in cases.items():
        r = _limited(argv, 64, tmp_path)  # 64 bytes: every output is larger
        assert r.returncode == 1, (name, r.returncode, r.stderr[-2000:])
        err = r.stderr.strip().splitlines()
        assert err and "Traceback" not in r.stderr and "nothing was written" in err[-1], (name, r.stderr[-2000:])
    assert sorted(p.name for p in out.iterdir()) == ["kept.html"] and old.read_text() == "the previous report"
    _no_partials(tmp_path)


def test_a_full_disk_during_import_leaves_no_trace(tmp_path: Path) -> None:
    snap = tmp_path / "s.pickle"
    from npu_pool.analysis.memviz import export

    export([training(layers=2, iters=2)], "npu_pool", snap)
    r = _limited(["import", str(snap), "--out", str(tmp_path / "imported")], 64, tmp_path)
    assert r.returncode == 1 and "nothing was written" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not list((tmp_path / "imported").glob("*.npt"))
    _no_partials(tmp_path)


def test_an_oom_snapshot_on_a_full_disk_is_not_left_torn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = Pool("npu_pool", capacity=64 * MiB)
    monkeypatch.setenv(oom.ENV, str(tmp_path / "snaps"))
    real = outputs.os.fsync

    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(outputs.os, "fsync", full)
    with pytest.raises(OutOfMemoryError) as e:
        pool.malloc(1 << 40)
    assert "cannot write" in str(e.value) and "No space left on device" in str(e.value)
    monkeypatch.setattr(outputs.os, "fsync", real)
    assert list((tmp_path / "snaps").iterdir()) == []


def test_ctrl_c_during_export_leaves_no_pickle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture) -> None:
    from npu_pool import snapshot

    trace = tmp_path / "t.npt"
    synthetic(40_000).save(trace)
    dest = tmp_path / "x.pickle"
    dest.write_bytes(b"an older export")
    calls = []
    real = snapshot._append_batch

    def interrupted(f, batch):  # noqa: ANN001
        calls.append(1)
        if len(calls) == 2:  # the first batch is on disk: the file is half written
            raise KeyboardInterrupt
        real(f, batch)

    monkeypatch.setattr(snapshot, "_append_batch", interrupted)
    assert main(["export", str(trace), "--out", str(dest)]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert dest.read_bytes() == b"an older export"
    _no_partials(tmp_path)


def test_sigterm_during_a_write_removes_the_partial_file(tmp_path: Path) -> None:
    dest = tmp_path / "big.bin"
    code = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        from npu_pool.outputs import output
        with output({str(dest)!r}) as f:
            f.write(b"x" * 100000)
            f.flush()
            os.kill(os.getpid(), signal.SIGTERM)
            f.write(b"never")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGTERM, r.stderr
    assert not dest.exists() and not outputs.partial_path(dest).exists()


def test_a_second_writer_is_refused_while_the_first_writes(tmp_path: Path) -> None:
    dest = tmp_path / "t.npt"
    with outputs.output(dest) as f:
        f.write(b"first")
        with pytest.raises(outputs.OutputBusy, match="another process is writing it"):
            with outputs.output(dest) as g:
                g.write(b"second")
    assert dest.read_bytes() == b"first"
    # from another process too, and through a command
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from npu_pool.outputs import output
        with output({str(dest)!r}) as f:
            f.write(b"held"); f.flush(); print("holding", flush=True); time.sleep(30)
    """)
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(outputs.OutputBusy):
            training(layers=1, iters=1).save(dest)
    finally:
        holder.kill()
        holder.wait()
    assert dest.read_bytes() == b"first"  # the killed writer left the old file


def test_two_imports_to_one_folder_leave_a_file_that_reads_back(tmp_path: Path) -> None:
    from npu_pool.analysis.memviz import export

    snap = tmp_path / "s.pickle"
    export([synthetic(30_000)], "npu_pool", snap)
    argv = [sys.executable, "-m", "npu_pool.cli", "import", str(snap), "--out", str(tmp_path / "o")]
    procs = [subprocess.Popen(argv, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    assert any(rc == 0 for rc, _ in results), results
    for rc, err in results:
        assert rc == 0 or ("another process is writing it" in err and len(err.strip().splitlines()) == 1), err
    (npt,) = (tmp_path / "o").glob("*.npt")
    assert len(Trace.load(npt)) > 30_000
    _no_partials(tmp_path)


def test_an_import_whose_folder_another_failed_import_removed_still_writes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Two imports into one new folder: the second, finding the first's file claimed while both
    checked it, failed and removed the folder it took for its own (both had found none), while the
    first read its snapshot; the first then could not write (seen once in CI, the test above). Only
    the run that made the folder removes it, and a run makes it again before it writes."""
    import importlib

    from npu_pool.analysis.memviz import export

    importing = importlib.import_module("npu_pool.commands.import")  # (a keyword: no import statement)
    snap = tmp_path / "s.pickle"
    export([synthetic(3_000)], "npu_pool", snap)
    out = tmp_path / "o"
    read = importing.load_snapshot

    def read_while_another_cleans_up(path: Path) -> list[Trace]:
        traces = read(path)
        out.rmdir()  # (what the other import's cleanup did meanwhile)
        return traces

    monkeypatch.setattr(importing, "load_snapshot", read_while_another_cleans_up)
    assert main(["import", str(snap), "--out", str(out)]) == 0
    (npt,) = out.glob("*.npt")
    assert len(Trace.load(npt)) > 3_000 and "s.dev0.npt" in capsys.readouterr().out
    monkeypatch.undo()
    out2 = tmp_path / "o2"
    out2.mkdir()  # another run's folder: a failed import leaves it where it found it
    assert main(["import", str(tmp_path / "missing.pickle"), "--out", str(out2)]) != 0
    assert out2.is_dir()


# -- 2. costs without bounds: YAML bombs -------------------------------------------------------

_BOMB = "".join([
    'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n',
    *(f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefg", "bcdefgh")),
])


@pytest.mark.parametrize("key", ["npu_pool_policy", "npu_pool_fraction", "npu_pool_plan"])
def test_a_billion_laughs_config_is_refused_at_once(tmp_path: Path, key: str) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(_BOMB + f"{key}: [*h, *h, *h, *h, *h, *h, *h, *h, *h]\n")
    assert path.stat().st_size < 1100
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="aliases") as e:
        config.load({config.CONFIG_FILE: str(path)})
    assert time.perf_counter() - t0 < 2 and len(str(e.value)) < 300


def test_a_billion_laughs_model_config_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(_BOMB + "hidden: 1024\nlayers: 2\nheads: 8\nvocab: 100\ndtype: [*h, *h, *h, *h, *h, *h]\n")
    tracemalloc.start()
    try:
        _one_line(capsys, ["estimate", "--config", str(path)], "bomb.yaml", "aliases", seconds=5)
        assert tracemalloc.get_traced_memory()[1] < 20 * MiB
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("text", ["１", "０.５", "٠.٥", "0.5_0", "\xa00.5", "0x1p-1", "5e-1.0", "."])
def test_a_fraction_is_ascii_decimal(text: str) -> None:
    """float() reads other scripts' digits and underscores; a setting is plain ASCII, as parse_int's."""
    with pytest.raises(ConfigError, match="NPU_POOL_FRACTION=.* is not valid"):
        config.parse_fraction(text)


def test_fraction_and_switch_spellings_that_are_taken() -> None:
    assert [config.parse_fraction(t) for t in (" 0.5\t", "+0.5", "5e-1", ".5", "1", 1, 0.25)] == \
        [0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 0.25]
    assert config.parse_enabled(" 1\n") is True
    with pytest.raises(ConfigError):
        config.parse_enabled("\xa01\xa0")  # a no-break space is not white space a shell leaves
    with pytest.raises(ConfigError):
        config.parse_fraction(10 ** 400)


def test_a_plan_setting_says_what_it_names(tmp_path: Path) -> None:
    """NPU_POOL_PLAN naming a folder, a device or nothing said only "is not valid", where the CLI
    and the API say what the file is (a review of the planner)."""
    for value, said in ((str(tmp_path), "is not a regular file (a directory)"),
                        ("/dev/zero", "is not a regular file (a character device)"),
                        (str(tmp_path / "none.npplan"), "cannot be read (No such file or directory)"),
                        (" ", "is not valid")):
        with pytest.raises(ConfigError, match=re.escape(said) + ": name a plan file written by `npu-pool plan`"):
            config.parse_plan(value)
    (tmp_path / "p.npplan").write_bytes(b"")
    assert config.parse_plan(str(tmp_path / "p.npplan")) == str(tmp_path / "p.npplan")  # (read and checked later)


def test_messages_never_expand_a_large_value() -> None:
    big = list(range(10 ** 6))
    for parse in (config.parse_policy, config.parse_fraction, config.parse_enabled, config.parse_plan):
        with pytest.raises(ConfigError) as e:
            parse(big)
        assert len(str(e.value)) < 200
    from npu_pool.analysis.estimate import config_from_dict

    with pytest.raises(ValueError) as e:
        config_from_dict({"hidden": 8, "layers": 1, "heads": 1, "vocab": 8, "optimizer": "x" * 10 ** 6})
    assert len(str(e.value)) < 200


# -- 3. export and import stream -----------------------------------------------------------------

@pytest.mark.slow
def test_export_and_import_memory_is_a_small_multiple_of_the_input(tmp_path: Path) -> None:
    """Python-side peak memory (tracemalloc) against the input file's size: the export streams
    from the core's compact history (~3.8x; building the whole snapshot in memory took ~29x), the
    import streams the file range by range (~2.1x; ~9x when it unpickled the file whole).
    benchmarks/io_memory.py measures RSS and time on larger traces."""
    from npu_pool.analysis.memviz import export

    npt, out = tmp_path / "t.npt", tmp_path / "t.pickle"
    trace = synthetic(40_000)
    trace.save(npt)
    del trace
    tracemalloc.start()
    try:
        export([Trace.load(npt)], "npu_pool", out)
        export_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        (back,) = load_snapshot(out)
        import_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert export_peak < 8 * npt.stat().st_size, (export_peak, npt.stat().st_size)
    assert import_peak < 3 * out.stat().st_size, (import_peak, out.stat().st_size)
    assert sum(op == OP_ALLOC for op in back.op) == sum(op == OP_ALLOC for op in Trace.load(npt).op)


def test_a_streamed_export_is_the_snapshot(tmp_path: Path) -> None:
    from npu_pool.analysis.memviz import export, snapshot_of

    traces = [training(layers=2, iters=3)]
    for policy in ("npu_pool", "torch"):
        done = export(traces, policy, tmp_path / "x.pickle")
        back = pickle.loads((tmp_path / "x.pickle").read_bytes())
        snap = snapshot_of(traces, policy)
        assert back == snap and done.entries == len(snap["device_traces"][0]) > 0
        assert done.segments == len(snap["segments"])


# -- 4. the first bytes say what a file is ------------------------------------------------------

def test_import_checks_what_a_file_is_before_reading_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    npt = tmp_path / "t.npt"
    training(layers=1, iters=1).save(npt)
    out = tmp_path / "out"
    _one_line(capsys, ["import", str(npt), "--out", str(out)], "already an npu_pool trace")
    _one_line(capsys, ["import", "/dev/zero", "--out", str(out)], "/dev/zero", "not a regular file")
    _one_line(capsys, ["import", str(tmp_path / "missing.pickle"), "--out", str(out)], "cannot read")
    junk = tmp_path / "junk.pickle"
    with open(junk, "wb") as f:  # 200 MB of zeros (sparse): no pickle
        f.truncate(200 * MiB)
    tracemalloc.start()
    try:
        _one_line(capsys, ["import", str(junk), "--out", str(out)], "junk.pickle", "not a valid pickle")
        assert tracemalloc.get_traced_memory()[1] < 4 * MiB
    finally:
        tracemalloc.stop()
    huge = tmp_path / "huge.pickle"  # a BINBYTES8 claiming 1 TiB in a 1 KB file
    huge.write_bytes(b"\x80\x04\x8e" + (1 << 40).to_bytes(8, "little") + bytes(1000))
    _one_line(capsys, ["import", str(huge), "--out", str(out)], "huge.pickle")
    assert not out.exists()  # no empty output folder for a failed import


def test_plans_are_checked_before_they_are_read(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    trace = training(layers=2, iters=3)
    npt = tmp_path / "t.npt"
    trace.save(npt)
    plan = tmp_path / "p.npplan"
    save_plan(make_plan(trace), plan)
    assert load_plan(plan).n > 0
    with pytest.raises(PlanError, match="trace, not a plan"):
        load_plan(npt)
    with pytest.raises(PlanError, match="not a regular file"):
        load_plan("/dev/zero")
    data = plan.read_bytes()
    (tmp_path / "cut.npplan").write_bytes(data[:-5])
    with pytest.raises(PlanError, match="truncated or corrupt"):
        load_plan(tmp_path / "cut.npplan")
    grown = tmp_path / "grown.npplan"
    with open(grown, "wb") as f:  # a plan's header followed by 300 MB (sparse): refused unread
        f.write(data)
        f.truncate(300 * MiB)
    tracemalloc.start()
    try:
        with pytest.raises(PlanError, match="truncated or corrupt"):
            load_plan(grown)
        assert tracemalloc.get_traced_memory()[1] < 4 * MiB
    finally:
        tracemalloc.stop()
    _one_line(capsys, ["replay", str(npt), "--policy", "planned", "--plan", str(npt), "--no-min-capacity"],
              "not a plan")


# -- 5. an OOM with snapshots on stays fast ------------------------------------------------------

def test_an_oom_snapshot_of_a_long_run_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = Pool("npu_pool", capacity=1 << 30)
    pool.set_history(oom.HISTORY_WHEN_ENABLED)
    for _ in range(oom.HISTORY_WRITTEN):  # twice the history a snapshot writes
        pool.free(pool.malloc(4096))
    monkeypatch.setenv(oom.ENV, str(tmp_path))
    t0 = time.perf_counter()
    with pytest.raises(OutOfMemoryError) as e:
        pool.malloc(1 << 40)
    took = time.perf_counter() - t0
    (pkl,) = tmp_path.glob("oom_snapshot_*.pickle")
    (js,) = tmp_path.glob("oom_snapshot_*.json")
    assert str(pkl) in str(e.value) and js.stem == pkl.stem
    snap = pickle.loads(pkl.read_bytes())
    entries = snap["device_traces"][0]
    assert entries[-1]["action"] == "oom" and len(entries) <= 2 * oom.HISTORY_WRITTEN
    doc = json.loads(js.read_text())
    assert doc["snapshot"] == pkl.name and len(doc["history"]) == oom.HISTORY_IN_JSON
    assert doc["history"][-1]["kind"] == "oom" and js.stat().st_size < 64 * 1024
    assert took < 10, took  # ~0.2 s (benchmarks/oom_snapshot.py); seconds of slack for a loaded machine


# -- 6. a user's mistake is a ConfigError or a one-line error, never a traceback -----------------

@pytest.mark.parametrize("content,words", [
    (bytes(range(128, 256)) * 8, "not UTF-8"),
    ("npu_pool_policy: café\n".encode("latin-1"), "not UTF-8"),
    ("npu_pool_policy: torch\n".encode("utf-16"), "not UTF-8"),
    (b"npu_pool_policy: " + b"[" * 100_000, "nested too deeply"),
    (b"npu_pool_fraction: " + b"9" * 5000, "5000 digits"),
    (b"npu_pool_policy: {a: 1}\n", "is not valid"),
    (b"? [1, 2]\n: 3\n", "not valid YAML"),
    (b"1: 2\n", "unknown key"),
    (b"\x00\x01", "not valid YAML"),
], ids=["bytes", "latin-1", "utf-16", "deep", "5000-digits", "mapping", "list-key", "int-key", "control"])
def test_bad_config_files_are_config_errors(tmp_path: Path, content: bytes, words: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=words) as e:
        config.load({config.CONFIG_FILE: str(path)})
    assert str(path) in str(e.value) or "NPU_POOL_POLICY" in str(e.value) or "npu_pool_policy" in str(e.value)
    assert len(str(e.value)) < 400


def test_a_random_config_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_bytes(os.urandom(4096))
    with pytest.raises(ConfigError, match="r.yaml"):
        config.load({config.CONFIG_FILE: str(path)})


@pytest.mark.parametrize("text", ["²", "١٢", "1e3", "-1", "0x10", "1_000", " ", "9" * 30])
def test_numbers_from_the_environment_are_ascii_digits(text: str) -> None:
    with pytest.raises(ConfigError, match="ASCII digits|whole number"):
        config.parse_int(text, "X")
    assert config.parse_int(" 12 ", "X") == 12


def test_a_bad_rank_or_log_interval_never_loses_the_report(monkeypatch: pytest.MonkeyPatch) -> None:
    from mindspeed_patch.megatron import parse_log_every
    from npu_pool.recorder import report

    with pytest.raises(ConfigError, match="NPU_POOL_LOG_EVERY"):
        parse_log_every("²")
    assert parse_log_every("10") == 10
    monkeypatch.setenv("RANK", "²")
    monkeypatch.setenv("WORLD_SIZE", "²")
    dist = getattr(sys.modules.get("torch"), "distributed", None)
    if dist is not None:  # (a test before may have left a process group: its rank would be the answer)
        monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.warns(RuntimeWarning, match="RANK"):
        assert report.rank_and_world() == (0, None)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert report.rank_and_world() == (3, 8)


@pytest.mark.parametrize("body,words", [
    ("dtype: {a: 1}\n", "dtype must be"),
    ("optimizer: [adam]\n", "optimizer must be"),
    ("hidden: true\n", "hidden must be"),
    ("layers: 100000000000000000000000\n", "layers must be"),
    ("1: 2\n", "not a name"),
    ("model: " + "{a: " * 100 + "1" + "}" * 100 + "\n", "nested too deeply"),
    ("kv_heads: 3\n", "kv_heads=3 must divide heads=16"),
    ("kv_heads: 32\n", "kv_heads=32 must divide heads=16"),
    ("experts: 8\ntop_k: 9\n", "top_k=9 must be in 1..experts=8"),
    ("pp: 8\n", "pp=8 stages for 4 layers"),
    ("hidden: 2048\nhidden: 4096\n", "line 5: 'hidden' is given twice (first on line 4)"),
    ("pp: 3\n", "layers=4 not divisible by pp=3"),  # (stages left empty before)
    ("ep: 8\n", "ep=8 divides the experts"),  # (accepted and shown, meaning nothing)
    ("experts: 1\n", "top_k=2 must be in 1..experts=1 (2 unless given: give top_k too)"),
    ("seq: 4096\nmax_positions: 10\n", "seq=4096 passes max_positions=10"),
    ("model_type: llama\narchitectures: [LlamaForCausalLM]\n", "this is a Hugging Face config.json (model 'llama')"),
], ids=["dtype-mapping", "optimizer-list", "bool-int", "huge-int", "int-key", "deep", "kv-heads-not-dividing",
        "kv-heads-over-heads", "top-k-over-experts", "pp-over-layers", "repeated-key", "pp-not-dividing",
        "ep-without-experts", "default-top-k", "seq-over-learned-positions", "hugging-face-config"])
def test_bad_model_configs_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture, body: str, words: str) -> None:
    path = tmp_path / "m.yaml"
    base = {"hidden": 1024, "layers": 4, "heads": 16, "vocab": 32000}  # less the key the case gives
    path.write_text("".join(f"{k}: {v}\n" for k, v in base.items() if not body.startswith(f"{k}:")) + body)
    _one_line(capsys, ["estimate", "--config", str(path)], "m.yaml", words)


@pytest.mark.parametrize("change,words", [
    ({"step_seconds": [1, 2]}, "step_seconds should be an object"),
    ({"step_seconds": {"mean": "slow"}}, "step_seconds values"),
    ({"memory": [1]}, "memory should be"),
    ({"memory": {"peak_reserved_bytes": "x"}}, "memory.peak_reserved_bytes"),
    ({"memory": {"pools": {"long": 3}}}, "memory.pools"),
    ({"iterations": 1e400}, "iterations"),
    ({"rank": -1}, "rank should be"),
    ({"memory": {"peak_reserved_bytes": -5}}, "memory.peak_reserved_bytes should be a number >= 0"),
    ({"memory": {"peak_allocated_bytes": 10, "peak_reserved_bytes": 5, "utilization": 0.9}},
     "memory.utilization is 0.9, but peak allocated / peak reserved is 10/5: the figures do not add up"),
    ({"step_seconds": {"mean": -1.0}}, "step_seconds values should be numbers >= 0"),
    ({"rank": 3}, "the report of rank 3 under another name"),  # npu_pool_rank0.json claiming rank 3
])
def test_merge_refuses_malformed_reports_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture, change: dict,
                                                     words: str) -> None:
    good = {"version": 1, "rank": 0, "mode": "device", "iterations": 3,
            "step_seconds": {"mean": 1.0, "max": 1.0, "last": 1.0},
            "memory": {"peak_allocated_bytes": 1, "peak_reserved_bytes": 2, "utilization": 0.5,
                       "device_mallocs": 1, "ooms": 0, "pools": {}}}
    (tmp_path / "npu_pool_rank0.json").write_text(json.dumps({**good, **change}).replace("Infinity", "1e400"))
    _one_line(capsys, ["merge", str(tmp_path)], "npu_pool_rank0.json", words)
    (tmp_path / "npu_pool_rank0.json").write_text(json.dumps(good))
    assert main(["merge", str(tmp_path)]) == 0


def test_merge_shows_a_report_without_step_times(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """step_seconds is optional (a run that never finished a step): a '-' cell, not a KeyError."""
    (tmp_path / "npu_pool_rank0.json").write_text(json.dumps({"version": 1, "rank": 0}))
    assert main(["merge", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert "Traceback" not in out.err and out.out.splitlines()[2].split()[:3] == ["0", "?", "-"]


def test_outputs_refuse_a_directory_and_name_a_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(IsADirectoryError, match="is a directory"):
        outputs.write_bytes(tmp_path, b"x")
    with pytest.raises(OSError, match="nothing was written"):
        outputs.write_bytes(tmp_path / "no" / "such" / "f.bin", b"x")
    threads = [threading.Thread(target=outputs.write_text, args=(tmp_path / f"f{i}.txt", "x" * i)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(p.read_text() for p in tmp_path.glob("f*.txt")) == sorted("x" * i for i in range(8))
    _no_partials(tmp_path)


def test_a_fifo_or_device_as_a_config_or_report_is_refused_without_blocking(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture) -> None:
    fifo = tmp_path / "c.yaml"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero"), tmp_path):
        with pytest.raises(ConfigError, match="not a regular file"):
            config.load({config.CONFIG_FILE: str(path)})
    _one_line(capsys, ["estimate", "--config", str(fifo)], "not a regular file", seconds=5)
    reports = tmp_path / "reports"
    reports.mkdir()
    os.mkfifo(reports / "npu_pool_rank0.json")
    _one_line(capsys, ["merge", str(reports)], "npu_pool_rank0.json", "not a regular file", seconds=5)


def test_one_event_list_for_two_devices_is_refused_and_shared_entries_are_read(tmp_path: Path) -> None:
    """The import converts each device's entries in place; a list given to two devices (no real
    snapshot does that) is refused, entries shared between two lists are read for both."""
    entries = [{"action": "alloc", "addr": 4096 * (i + 1), "size": 100, "stream": 0, "frames": []} for i in range(5)]
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [entries, entries]}))
    with pytest.raises(TraceError, match=r"device_traces\[1\] is the same list"):
        load_snapshot(path)
    path.write_bytes(pickle.dumps({"device_traces": [entries, list(entries)]}))
    assert [len(t) for t in load_snapshot(path)] == [5, 5]


def test_a_trace_with_a_malformed_capture_config_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    trace = training(layers=1, iters=1)
    trace.meta["capture"] = {"model": "llama", "seq": [1], "batch": 1}
    path = tmp_path / "t.npt"
    trace.save(path)
    _one_line(capsys, ["estimate", "--trace", str(path)], "meta['capture'] is malformed")
    # fields of the wrong type are named, not read loosely ("no" was a full recompute, 2.7 a tp of 2)
    for field, value, words in (("recompute", "no", "recompute is 'no', not true or false"),
                                ("tp", 2.7, "tp is '2.7', not a whole number"),
                                ("seq", "1024", "seq is '1024', not a whole number")):
        trace.meta["capture"] = {"model": "llama", "seq": 64, "batch": 1, field: value}
        trace.save(path)
        _one_line(capsys, ["estimate", "--trace", str(path)], f"meta['capture'] is malformed: {words}")


@pytest.mark.slow
def test_a_real_ctrl_c_while_the_export_is_written_leaves_nothing(tmp_path: Path) -> None:
    trace, dest = tmp_path / "t.npt", tmp_path / "x.pickle"
    synthetic(150_000).save(trace)
    proc = subprocess.Popen([sys.executable, "-m", "npu_pool.cli", "export", str(trace), "--out", str(dest)],
                            cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    part = outputs.partial_path(dest)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if part.exists() and part.stat().st_size > 1 << 20:  # a megabyte of the snapshot is on disk
            proc.send_signal(signal.SIGINT)
            break
        time.sleep(0.005)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "interrupted" in err, (proc.returncode, err[-2000:])
    assert not dest.exists() and not part.exists()


def test_a_fifo_as_a_plan_or_snapshot_is_refused_without_blocking(tmp_path: Path) -> None:
    """Every reader opens through npu_pool.inputs.open_regular: a FIFO without a writer given as
    a plan (--plan, load_plan) or a snapshot (import, load_snapshot) is refused at once, where a
    plain open() would wait for a writer forever. Run in a child with a time limit: a regression
    hangs there, not here."""
    for name in ("p.npplan", "s.pickle"):
        os.mkfifo(tmp_path / name)
    trace = tmp_path / "t.npt"
    training(iters=3).save(trace)
    script = textwrap.dedent(f"""
        import json
        from pathlib import Path
        from npu_pool.cli import main
        from npu_pool.inputs import NotRegularFile, open_regular
        from npu_pool.planner import PlanError, load_plan
        from npu_pool.trace.format import TraceError
        from npu_pool.trace.snapshot import load_snapshot
        d, out = Path({str(tmp_path)!r}), {{}}
        for what, call, err in (("plan", lambda: load_plan(d / "p.npplan"), PlanError),
                                ("snapshot", lambda: load_snapshot(d / "s.pickle"), TraceError),
                                ("directory", lambda: open_regular(d), NotRegularFile)):
            try:
                call()
                out[what] = "no error"
            except err as e:
                out[what] = str(e)
        out["replay"] = main(["replay", str(d / "t.npt"), "--policy", "planned", "--plan", str(d / "p.npplan"),
                              "--no-min-capacity"])
        out["import"] = main(["import", str(d / "s.pickle"), "--out", str(d / "imported")])
        print(json.dumps(out))
        """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                       cwd=str(Path(__file__).resolve().parents[1]))
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["plan"] == f"{tmp_path / 'p.npplan'}: not a regular file (a FIFO); give a plan file"
    assert out["snapshot"] == f"{tmp_path / 's.pickle'}: not a regular file (a FIFO); give a snapshot file"
    assert out["directory"] == f"{tmp_path}: not a regular file (a directory)"
    assert out["replay"] == 1 and out["import"] == 1
    assert "Traceback" not in r.stderr and "not a regular file" in r.stderr
    assert not (tmp_path / "imported").exists()


# ---- outputs that are inputs, special files, traces past the simulated device -------------------
def test_an_output_that_is_an_input_of_the_command_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    trace = tmp_path / "a.npt"
    small_trace(2).save(trace)
    before = trace.read_bytes()
    link = tmp_path / "link.npt"
    link.symlink_to(trace)
    for argv in (["replay", str(trace), "--no-min-capacity", "--json", str(trace)],
                 ["replay", str(link), "--no-min-capacity", "--json", str(trace)],  # the same file by another name
                 ["plan", str(trace), "--out", str(trace)],
                 ["analyze", str(trace), "--out", str(trace)]):
        _one_line(capsys, argv, "a.npt: is also an input of this command; not overwritten")
        assert trace.read_bytes() == before
    assert main(["replay", str(trace), "--json", str(trace)]) == 1
    assert capsys.readouterr().out == ""  # refused before any replay (before: after all of them, tables printed)
    assert main(["replay", str(trace), "--no-min-capacity", "--json", str(tmp_path / "out.json")]) == 0  # others: fine
    capsys.readouterr()


def test_special_files_and_links_are_written_not_replaced(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    trace = tmp_path / "a.npt"
    small_trace(2).save(trace)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    _one_line(capsys, ["replay", str(trace), "--no-min-capacity", "--json", str(fifo)], "a FIFO nobody reads")
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    time.sleep(0.2)  # the reader opens the FIFO
    assert main(["replay", str(trace), "--no-min-capacity", "--json", str(fifo)]) == 0
    reader.join(10)
    assert fifo.is_fifo() and json.loads(got[0])[0]["peak_live_bytes"] == 2 * MiB
    link = tmp_path / "report.json"
    link.symlink_to("target.json")  # dangling: the file it names is created, the link kept
    assert main(["replay", str(trace), "--no-min-capacity", "--json", str(link)]) == 0
    assert link.is_symlink() and json.loads((tmp_path / "target.json").read_text())[0]["peak_live_bytes"] == 2 * MiB
    capsys.readouterr()
    if Path("/dev/full").is_char_device():
        _one_line(capsys, ["replay", str(trace), "--no-min-capacity", "--json", "/dev/full"], "/dev/full: cannot write")
        assert Path("/dev/full").is_char_device()
    capsys.readouterr()


def test_a_trace_past_the_simulated_device_says_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    big = tmp_path / "big.npt"
    small_trace(2, 3 << 39).save(big)  # 1.5 TiB live at once: past the 1 TiB of a room-to-spare replay
    _one_line(capsys, ["replay", str(big), "--no-min-capacity"], "the replay models one device of at most 1 TiB")
    assert main(["export", str(big), "--out", str(tmp_path / "big.pickle")]) == 0
    err = capsys.readouterr().err
    assert "stopped at trace event 0" in err and "the snapshot ends there" in err


def test_empty_paths_and_clashing_names_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _one_line(capsys, ["replay", ""], "argument TRACE: an empty value (an unset variable?)")
    snap = {"segments": [], "device_traces": [[]]}
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "x.pickle").write_bytes(pickle.dumps(snap))
    _one_line(capsys, ["import", "--out", str(tmp_path / "out"), str(tmp_path / "a" / "x.pickle"),
                       str(tmp_path / "b" / "x.pickle")], "would both be written as x.dev<N>.npt")
    assert not (tmp_path / "out").exists()


def test_capture_saves_its_trace_before_printing(tmp_path: Path) -> None:
    """A summary that cannot be printed (stdout on a full disk) must not lose the trace."""
    if not Path("/dev/full").is_char_device():
        unavailable("no /dev/full")
    out = tmp_path / "c.npt"
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "npu_pool.cli", "capture", "--steps", "1", "--layers", "1",
                            "--out", str(out)], stdout=full, stderr=subprocess.PIPE, text=True, cwd=str(ROOT),
                           timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert Trace.load(out).validate(str(out)) is None


def test_malformed_meta_of_traces_and_plans_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A trace's or a plan's meta is input like the rest: fields of the wrong type are named in one
    line, never a TypeError, KeyError or ZeroDivisionError from deep inside a report."""
    def with_meta(name: str, **meta: object) -> str:
        t = small_trace(2)
        t.meta.update(meta)
        t.save(tmp_path / name)
        return str(tmp_path / name)

    _one_line(capsys, ["analyze", with_meta("o.npt", ooms=5)], "meta['ooms'] is malformed")
    _one_line(capsys, ["analyze", with_meta("p.npt", ooms=[{"event": 1, "size": [1]}])], "meta['ooms'] is malformed")
    for command in (["replay"], ["plan", "--out", str(tmp_path / "x.npplan")], ["export", "--out", str(tmp_path / "x.pickle")]):
        # one rule for every command (Trace.validate): before, only analyze read the list
        _one_line(capsys, [command[0], with_meta("q.npt", ooms=[123456]), *command[1:]], "meta['ooms'] is malformed")
    capture = {"model": "gpt", "steps": 1, "batch": 4, "seq": 128, "layers": 4, "dim": 128, "heads": 0, "vocab": 512,
               "recompute": False, "grad_accum": 1, "mixed_precision": None, "fake": False}
    _one_line(capsys, ["estimate", "--trace", with_meta("c.npt", capture=capture)], "meta['capture'] is malformed")
    assert main(["replay", "--validate", with_meta("r.npt", recorded=7)]) == 1  # skipped, saying why: nothing compared
    assert "skipped: r: the trace's meta['recorded'] is malformed" in capsys.readouterr().out
    plan = make_plan(training())
    plan.meta["peak_live_bytes"] = "many"
    save_plan(plan, tmp_path / "bad.npplan")
    _one_line(capsys, ["plan", "--check", str(tmp_path / "bad.npplan")], "the plan's meta is malformed")


def test_demo_says_when_the_snapshot_folder_it_was_given_is_unusable(tmp_path, monkeypatch, capsys) -> None:
    """`demo --shared DIR` named by the user: a missing folder, a file, an empty path or a folder
    without snapshots is an error in one line (it printed nothing and exited 0); without --shared
    an absent ../shared is skipped as before, and with nothing left to replay the demo says so."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    monkeypatch.chdir(tmp_path)  # a folder holding a snapshot: "" must not stand for it
    (tmp_path / "x.pickle").write_bytes(b"not read")
    for arg, why in ((tmp_path / "absent", "not a folder"), (tmp_path / "file", "not a folder"), ("", "argument --shared: an empty value"),
                     (tmp_path / "empty", "no snapshots")):
        assert main(["demo", "--no-capture", "--no-case", "--shared", str(arg)]) == 1
        err = capsys.readouterr().err
        assert why in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_demo_refuses_a_policy_list_before_any_work(capsys) -> None:
    """`demo --policy` was read after the 7B case had run (seconds of work, then the error), and its
    message offered `planned`, which the demo then refused."""
    for spec, why in (("foo", "unknown policy foo; choose from torch, npu_pool, expandable\n"),
                      ("planned", "the planned policy needs a plan")):
        assert main(["demo", "--no-capture", "--policy", spec]) == 2  # (the command line: as argparse's)
        out = capsys.readouterr()
        assert out.out == "" and why in out.err and out.err.count("\n") == 1, out


def test_mistakes_in_the_command_line_exit_2_before_any_file_is_read(tmp_path, capsys) -> None:
    """docs/cli.md: options that do not go together or a value of the wrong form exit 2, as
    argparse's own refusals do; those only a command could see exited 1, as a bad file does (a
    review, 2026-11-27). The trace named does not exist: each is said before it would be read."""
    absent = str(tmp_path / "absent.npt")
    for argv, words in ((["replay", absent, "--live", "--policy", "torch"], "--live takes no --policy"),
                        (["replay", absent, "--plan", "p.npplan"], "add planned to --policy"),
                        (["replay", absent, "--policy", "bogus"], "unknown policy bogus"),
                        (["analyze", absent, "--policy", "planned"], "needs a plan"),
                        (["export", absent, "--policy", "planned", "-o", str(tmp_path / "x.pickle")], "needs a plan"),
                        (["export", absent, "-o", str(tmp_path / "x.npt")], "name it .pickle"),
                        (["plan"], "give a TRACE"), (["plan", "--check", absent, "--out", "x"], "drop --out"),
                        (["estimate"], "give --config")):
        _one_line(capsys, argv, f"npu-pool {argv[0]}: error: ", words, code=2)
    _one_line(capsys, ["replay", absent], "absent.npt")  # the file itself: 1


def test_a_file_named_with_a_newline_is_named_whole_in_the_error(tmp_path, capsys) -> None:
    """The CLI printed only the first line of an error: "error: /tmp/no" for a missing file named
    "/tmp/no<newline>such.npt", no reason given (a review, 2026-11-27)."""
    name = str(tmp_path / "no\nsuch")
    for argv in (["analyze", name + ".npt"], ["import", name + ".pickle", "--out", str(tmp_path / "o")],
                 ["export", name + ".npt", "-o", str(tmp_path / "x.pickle")]):
        _one_line(capsys, argv, "no\\x0asuch.", "cannot read")


def test_ctrl_c_while_a_command_loads_is_one_line(monkeypatch, capsys) -> None:
    """Ctrl-C in capture's first second or two (its options' module imports torch, before the
    command's own handling) printed a KeyboardInterrupt traceback (a review, 2026-11-27)."""
    import npu_pool.commands.capture as capture_command

    def loading(p) -> None:  # noqa: ANN001
        raise KeyboardInterrupt

    monkeypatch.setattr(capture_command, "add_arguments", loading)
    assert main(["capture", "--steps", "1"]) == 130
    assert capsys.readouterr().err == "npu-pool: interrupted\n"


def test_a_fake_capture_too_large_for_any_device_is_refused_before_it_starts(capsys) -> None:
    """--batch 99999999999 of a fake 7B capture ended in torch's "Storage size calculation
    overflowed" after 160 lines of its log (a review, 2026-11-27); 1e10 was refused after the
    capture, by the trace's validation."""
    for extra in (["--steps", "1"], ["--colocated", "1"], ["--model", "moe"]):
        _one_line(capsys, ["capture", "--shape", "7b", "--layers", "1", "--batch", "99999999999", "--no-progress",
                           *extra], "batch 99999999999 x sequence", "more than any device has")


def test_replay_validate_that_compares_nothing_does_not_pass(tmp_path, capsys) -> None:
    """`replay --validate` over traces that carry no recorded figures (captures, synthetic traces)
    skips each with its reason; when every trace was skipped it exits 1 and says so (it exited 0,
    as if the model had been checked)."""
    from test_hostile import small_trace

    small_trace().save(tmp_path / "a.npt")
    small_trace(8).save(tmp_path / "b.npt")
    assert main(["replay", "--validate", str(tmp_path / "a.npt"), str(tmp_path / "b.npt")]) == 1
    out, err = capsys.readouterr()
    assert out.count("skipped:") == 2 and "compared nothing" in err and "Traceback" not in err


def test_replay_validate_and_live_refuse_options_they_would_not_use(tmp_path, capsys) -> None:
    """`replay --validate` replays the torch model only: --policy, --hints, --costs and --plan were
    ignored without a word (`--policy bogus` exited 0); --json was ignored too, and now gets the
    comparison's records. A snapshot whose request the simulated device cannot hold is skipped in
    one line, as plain replay refuses it (it was a RuntimeError traceback)."""
    snap = tmp_path / "big.pickle"
    with open(snap, "wb") as f:
        pickle.dump({"segments": [], "device_traces": [[{"action": "alloc", "addr": 1 << 40, "size": 2 << 40,
                                                         "stream": 0, "frames": []}]]}, f)
    assert main(["replay", str(snap), "--validate"]) == 1
    out, err = capsys.readouterr()
    assert "skipped: big: policy torch failed at event 0 (a request of 2.00 TiB" in out and "Traceback" not in err
    assert main(["replay", str(snap), "--validate", "--device", "npu"]) == 2  # the recording's own rules are compared
    assert "--validate takes no --device" in capsys.readouterr().err
    assert main(["replay", str(snap), "--policy", ""]) == 1  # (an unset variable): no policy, not the defaults
    assert "argument --policy: an empty value" in capsys.readouterr().err
    assert main(["replay", str(tmp_path / "absent.npt"), "--policy", "bogus"]) == 2  # said before any trace is read
    assert "unknown policy bogus" in capsys.readouterr().err
    for flag, value in (("--policy", "bogus"), ("--hints", "none"), ("--costs", "c.json"), ("--plan", "p.npplan")):
        for mode in ("--validate", "--live"):
            assert main(["replay", str(snap), mode, flag, value]) == 2
            err = capsys.readouterr().err
            assert f"{mode} takes no {flag}" in err and err.count("\n") == 1, err
    shared = Path(__file__).resolve().parents[2] / "shared" / "traces" / "cnn-adam-train.pickle"
    if shared.is_file():
        out_json = tmp_path / "v.json"
        assert main(["replay", str(shared), "--validate", "--json", str(out_json)]) == 0
        (record,) = json.loads(out_json.read_text())
        assert record["trace"] == "cnn-adam-train" and record["passed"] is True and record["compared"] > 0


def test_replay_cost_table_is_bounded(tmp_path, capsys) -> None:
    """A cost past 1e9 microseconds is a mistake: an integer of 400 digits raised OverflowError, and
    1e308 summed to an estimate of inf; both are refused in one line, as NaN is."""
    from test_hostile import small_trace

    small_trace().save(tmp_path / "a.npt")
    for text in ("{\"malloc\": 1" + "0" * 400 + "}", "{\"malloc\": 1e308}", "{\"malloc\": NaN}", "{\"map\": -1}"):
        (tmp_path / "c.json").write_text(text)
        assert main(["replay", str(tmp_path / "a.npt"), "--no-min-capacity", "--costs", str(tmp_path / "c.json")]) == 1
        err = capsys.readouterr().err
        assert "must be a number of microseconds from 0 to 1e+09" in err and err.count("\n") == 1, err
    (tmp_path / "c.json").write_text("{\"malloc\": 1e9}")
    assert main(["replay", str(tmp_path / "a.npt"), "--no-min-capacity", "--costs", str(tmp_path / "c.json")]) == 0


def test_probe_of_2026_11_26_each_mistake_is_one_line(tmp_path, capsys, monkeypatch) -> None:
    """What a hostile-input probe found (each was a traceback, a silent wrong answer or a refusal
    of something legal): stdout closed at start (`>&-`: print() dropped every line, or
    AttributeError); two config names of one field that disagree (the last won); a plan of a
    request the simulated device cannot hold ('capacity must be a positive number of bytes, got 0');
    an output named '-' (a file named '-'); a file name of non-UTF-8 bytes in an HTML report
    (UnicodeEncodeError); an output name of 250 bytes (its partial file's name was too long)."""
    small_trace().save(tmp_path / "a.npt")
    monkeypatch.setattr(sys, "stdout", None)
    for argv in (["estimate", "--hidden", "512", "--layers", "2", "--heads", "8", "--vocab", "1000"],
                 ["replay", str(tmp_path / "a.npt"), "--no-min-capacity"], ["plan", str(tmp_path / "a.npt"), "--json"]):
        assert main(argv) == 1
        assert "standard output is closed" in capsys.readouterr().err
    monkeypatch.undo()
    (tmp_path / "c.yaml").write_text("hidden_size: 4096\nhidden: 1024\nnum_layers: 2\nnum_attention_heads: 8\n"
                                     "vocab_size: 1000\n")
    assert main(["estimate", "--config", str(tmp_path / "c.yaml")]) == 1
    err = capsys.readouterr().err
    assert "config keys 'hidden_size' (4096) and 'hidden' (1024) both give hidden, differently" in err
    (tmp_path / "c.yaml").write_text("hidden_size: 1024\nhidden: 1024\nnum_layers: 2\nnum_attention_heads: 8\n"
                                     "vocab_size: 1000\n")
    assert main(["estimate", "--config", str(tmp_path / "c.yaml")]) == 0  # the same value twice: fine
    # as a Megatron argument dump gives them: the tokenizer's vocabulary, unset or not, and the
    # padded one the embedding has (which wins); one dtype in two spellings
    for extra in ("vocab_size: null\npadded_vocab_size: 1024\n", "vocab_size: 1000\npadded_vocab_size: 1024\n",
                  "padded_vocab_size: 1024\nvocab_size: 1000\n", "params_dtype: bf16\ndtype: bfloat16\nvocab: 1024\n"):
        (tmp_path / "c.yaml").write_text("hidden: 1024\nnum_layers: 2\nnum_attention_heads: 8\n" + extra)
        assert main(["estimate", "--config", str(tmp_path / "c.yaml")]) == 0, extra
    (tmp_path / "c.yaml").write_text("hidden: 1024\nnum_layers: 2\nnum_attention_heads: 8\nvocab: 1000\n"
                                     "recompute_granularity: null\n")  # a dump's unset setting: the default
    assert main(["estimate", "--config", str(tmp_path / "c.yaml")]) == 0
    (tmp_path / "c.yaml").write_text("hidden: 1024\nnum_layers: 2\nnum_attention_heads: 8\nvocab: 1000\n"
                                     "untie_embeddings_and_output_weights: 'false'\n")
    assert main(["estimate", "--config", str(tmp_path / "c.yaml")]) == 1
    assert "untie_embeddings_and_output_weights must be true or false, not 'false'" in capsys.readouterr().err
    capsys.readouterr()
    huge = tmp_path / "huge.pickle"
    with open(huge, "wb") as f:
        pickle.dump({"segments": [], "device_traces": [[{"action": "alloc", "addr": 1 << 40, "size": 256 << 40,
                                                         "stream": 0, "frames": []}]]}, f)
    assert main(["plan", str(huge)]) == 1
    err = capsys.readouterr().err
    assert "a request of 256.00 TiB" in err and "models one device of at most 1 TiB" in err
    for argv in (["plan", str(tmp_path / "a.npt"), "--out", "-"], ["analyze", str(tmp_path / "a.npt"), "--out", "-"]):
        assert main(argv) == 1
        assert "an output named '-': name a file" in capsys.readouterr().err
    assert not Path("-").exists()
    odd = os.fsdecode(bytes(tmp_path) + b"/bad\xffname.npt")
    small_trace().save(odd)
    assert main(["analyze", odd, "--format", "html", "--out", str(tmp_path / "r.html"), "--no-progress"]) == 0
    assert "bad\\udcffname" in (tmp_path / "r.html").read_text("utf-8")  # escaped: the report stays UTF-8
    long = tmp_path / ("e" * 250)
    assert len(outputs.partial_path(long).name) <= 255 and outputs.partial_path(long).name.endswith(".partial")
    assert main(["plan", str(tmp_path / "a.npt"), "--out", str(long)]) == 0 and long.is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")] == []
    capsys.readouterr()


def test_pool_flags_and_replay_arguments_are_checked() -> None:
    """Pool(vmm="no") turned the virtual-memory API on (any true value did), and replay.run of a
    path raised AttributeError: 'str' object has no attribute 'meta'."""
    from npu_pool import replay
    from npu_pool.pool import InvalidArgumentError

    for kw in ({"vmm": "no"}, {"vmm": 0}, {"host_backed": "false"}, {"host_backed": 1}):
        with pytest.raises(InvalidArgumentError, match="must be True or False"):
            Pool("npu_pool", **kw)
    with pytest.raises(TypeError, match="run replays a Trace, not str"):
        replay.run("/tmp/a.npt", "npu_pool")


def test_estimate_refuses_zero_where_zero_meant_the_default(capsys) -> None:
    """`estimate --ffn 0` (or --kv-heads, --micro-batches, --max-positions 0) silently meant "the
    default" (4 x hidden, the heads, the pipeline depth, the sequence): now one line naming the field."""
    base = ["estimate", "--hidden", "512", "--layers", "2", "--heads", "8", "--vocab", "1000"]
    for flag, field in (("--ffn", "ffn"), ("--kv-heads", "kv_heads"), ("--micro-batches", "micro_batches"),
                        ("--max-positions", "max_positions")):
        assert main(base + [flag, "0"]) == 2  # (a value on the command line: a usage error)
        err = capsys.readouterr().err
        assert f"{field} must be a whole number in 1..1099511627775, or left out for its default, not 0" in err
        assert err.count("\n") == 1, err
        assert main(base + [flag, "-5"]) == 2
        assert f"{field} must be a whole number in 1..1099511627775, or left out" in capsys.readouterr().err
    assert main(base + ["--ffn", "1024"]) == 0


def test_capture_seed_out_of_range_is_named(capsys) -> None:
    """`capture --seed` past 64 bits said "Overflow when unpacking long long" from deep in torch;
    now argparse names the option and the range, before any model is built."""
    for seed in ("99999999999999999999999", "-1"):
        with pytest.raises(SystemExit) as e:
            main(["capture", "--seed", seed])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "argument --seed: must be in 0..18446744073709551615" in err and "Traceback" not in err


def test_analyze_html_of_the_current_folder_is_named_after_it(tmp_path, monkeypatch, capsys) -> None:
    """`analyze --format html .` wrote a hidden file named ".html" (the stem of "." is empty): now
    the report is named after the folder "." stands for."""
    from test_hostile import small_trace

    run_dir = tmp_path / "run7"
    run_dir.mkdir()
    small_trace().save(run_dir / "rank0.npt")
    monkeypatch.chdir(run_dir)
    assert main(["analyze", "--format", "html", "--no-progress", "."]) == 0
    assert (run_dir / "run7.html").is_file() and not (run_dir / ".html").exists()
    capsys.readouterr()


def test_plan_check_uses_the_trace_it_is_given_and_refuses_an_output(tmp_path, capsys) -> None:
    """`plan --check PLAN TRACE -o OUT` ignored TRACE and OUT: now TRACE is checked to run the plan's
    iteration (as replay checks before it installs a plan) and an output is refused, each in one line."""
    a, b, p = tmp_path / "a.npt", tmp_path / "b.npt", tmp_path / "a.npplan"
    assert main(["capture", "--shape", "7b", "--layers", "2", "--no-progress", "--out", str(a)]) == 0
    assert main(["capture", "--shape", "13b", "--layers", "2", "--no-progress", "--out", str(b)]) == 0
    assert main(["plan", str(a), "--out", str(p)]) == 0
    capsys.readouterr()
    assert main(["plan", "--check", str(p), str(a)]) == 0
    assert f"{p}: ok for a" in capsys.readouterr().out
    assert main(["plan", str(a), "--device", "npu", "--out", str(tmp_path / "n.npplan")]) == 0
    capsys.readouterr()
    assert main(["plan", "--check", str(tmp_path / "n.npplan"), str(a), "--device", "npu"]) == 0
    capsys.readouterr()
    for extra, words, code in (([str(b)], f"the plan {p} was made for a", 1),
                               (["--out", str(tmp_path / "x")], "drop --out", 2)):
        assert main(["plan", "--check", str(p)] + extra) == code
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err
    assert not (tmp_path / "x").exists()
    # made under torch_npu's request rules, checked against a trace replayed under CUDA's: refused, as replay does
    assert main(["plan", "--check", str(tmp_path / "n.npplan"), str(a)]) == 1
    assert "was made with npu's request rules" in capsys.readouterr().err


def test_a_folder_given_as_a_plan_is_called_a_folder(tmp_path, capsys) -> None:
    """`plan --check DIR` called the folder "a device, FIFO or socket": the message says what it is."""
    assert main(["plan", "--check", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path}: not a regular file (a directory); give a plan file" in err and err.count("\n") == 1


def test_a_fake_capture_too_large_to_hold_is_refused_before_it_is_built(capsys, monkeypatch) -> None:
    """Fake captures grew without a bound (`--colocated 100000000` took 14 GB in two minutes): their
    counts are now checked against the most events a capture holds before anything is built."""
    for args, words in ((["--colocated", "100000000"], "100000000 colocated cycles of 32 layers"),
                        (["--layers", "1000", "--steps", "1000"], "of 1000 layers"), (["--steps", "100000"], "100000 steps")):
        t0 = time.monotonic()
        assert main(["capture", "--shape", "7b", "--no-progress", *args]) == 1
        err = capsys.readouterr().err
        assert words in err and "more than the 16,777,216 a capture holds" in err and err.count("\n") == 1, err
        assert time.monotonic() - t0 < 30
    # a depth under that bound for one step still took hours (100,000 layers: 1.2 GB and growing
    # after two minutes): the layers have a bound of their own
    for layers in ("100000", "1025"):
        t0 = time.monotonic()
        assert main(["capture", "--shape", "7b", "--no-progress", "--layers", layers]) == 1
        err = capsys.readouterr().err
        assert f"layers={layers}: at most 1024" in err and err.count("\n") == 1, err
        assert time.monotonic() - t0 < 30
    # the estimates are low ones (an MoE step records more): past the bound, the capture stops itself
    import npu_pool.capture.fake as fake

    monkeypatch.setattr(fake, "MAX_EVENTS", 1000)
    with pytest.raises(ValueError, match="passed the 1,000 events a capture holds"):
        fake.fake_capture("moe", "7b", steps=1, layers=2, progress=False)  # estimated 240, records about 1600
    from npu_pool.capture.colocated import colocated_capture

    with pytest.raises(ValueError, match="passed the 1,000 events"):
        colocated_capture(2, layers=2, decode_steps=1)  # estimated 160, records thousands


@pytest.mark.parametrize("arg", [10 ** 9, 1 << 40, (1 << 63) - 1])
def test_a_large_marker_argument_sizes_nothing_in_analyze(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                         arg: int) -> None:
    """A marker's argument shares the id column: analyze sized its per-allocation arrays by it
    (10^9: 8.8 GB and 16 s for a three-event trace; 2^63-1: a traceback)."""
    t = Trace(meta={"n_ids": 1})
    t.append(OP_MARK, cat=MARK_ITER_BEGIN, id=arg)
    t.append(OP_ALLOC, id=0, size=MiB)
    t.append(OP_FREE, id=0, size=MiB)
    t.save(tmp_path / "t.npt")
    t0 = time.perf_counter()
    assert main(["analyze", str(tmp_path / "t.npt"), "--format", "json"]) == 0
    assert time.perf_counter() - t0 < 10
    assert json.loads(capsys.readouterr().out)["traces"][0]["peak_live_bytes"] == MiB


def test_capture_refuses_an_unwritable_out_before_it_trains(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Said at once, not after the training it would have thrown away (before: about 10 s of a
    one-layer model, then the error); and without Python's "[Errno N]"."""
    (tmp_path / "adir").mkdir()
    for out, words in ((tmp_path / "nodir" / "x.npt", ("nodir/x.npt: cannot write", "nothing was written")),
                       (tmp_path / "adir", ("adir: is a directory",)),
                       # a file that is there, in a folder that takes no new file: that is said (the
                       # reason alone read "No such file or directory"; a review of the reports)
                       (Path("/proc/version"), ("/proc/version: cannot write a file beside it in /proc",)),
                       (Path("/proc/npu_pool_none"), ("/proc/npu_pool_none: cannot write (",))):
        err = _one_line(capsys, ["capture", "--steps", "1", "--layers", "1", "--no-progress", "--out", str(out)], *words,
                        seconds=3.0)
        assert "[Errno" not in err
    assert not list(tmp_path.rglob("*.partial"))


def test_analyze_plan_and_import_refuse_an_unwritable_out_before_their_work(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """An output that cannot be written is said before the replays, the planning or the reading of
    a snapshot, and so is --estimate with no --config for a trace that is no known model's capture
    (before: after them, 6-36 s on a large trace; a review of the commands at scale, a helper); the
    work itself is not started (here it would raise)."""
    from npu_pool.analysis import report
    from npu_pool import planner
    import importlib

    importer = importlib.import_module("npu_pool.commands.import")
    trace = tmp_path / "t.npt"
    training(layers=1, iters=2).save(trace)

    def work(*args: object, **kwargs: object) -> None:
        raise AssertionError("the work began")

    monkeypatch.setattr(report, "analyze_trace", work)
    _one_line(capsys, ["analyze", str(trace), "--estimate"], "not a capture of a known model", "--config", seconds=3.0)
    monkeypatch.setattr(report, "analyze_paths", work)
    monkeypatch.setattr(planner, "make_plan", work)
    monkeypatch.setattr(importer, "load_snapshot", work)
    gone = tmp_path / "nodir"
    for argv in (["analyze", str(trace), "--format", "html", "--out", str(gone / "r.html")],
                 ["analyze", str(trace), "--format", "md", "--out", str(gone / "r.md")],
                 ["plan", str(trace), "--out", str(gone / "p.npplan")]):
        _one_line(capsys, argv, "nodir/", "cannot write", "nothing was written", seconds=3.0)
    _one_line(capsys, ["import", str(trace), "--out", "/proc/npu_pool_none"], "/proc/npu_pool_none: cannot create",
              seconds=3.0)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "t.dev0.npt").mkdir()  # the name the first trace would take: a folder
    _one_line(capsys, ["import", str(trace), "--out", str(tmp_path / "full")], "t.dev0.npt: is a directory", seconds=3.0)
    assert not gone.exists() and not list(tmp_path.rglob("*.partial"))


def test_replay_counts_each_policy_and_export_its_entries_on_the_bar(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Long work moves its bar (shown on a terminal only): replay counts a step per trace and policy
    (one large trace sat at 0/1 for a whole run of four policies) and export the entries it writes
    (it showed nothing for 20 s on a 4M-event trace; a review of the commands at scale, a helper)."""
    from npu_pool.analysis import memviz
    from npu_pool.commands import replay as replay_cmd
    from npu_pool.progress import ByteProgress

    n = 12000
    t = Trace(meta={"origin": "synthetic", "n_ids": n})
    for i in range(n):
        t.append(OP_ALLOC, id=i, size=MiB)
        t.append(OP_FREE, id=i, size=MiB)
    t.save(tmp_path / "t.npt")
    steps: list[int] = []

    def counted(items: list, **kwargs: object):
        for i in items:
            steps.append(i)
            yield i

    monkeypatch.setattr(replay_cmd, "progress", counted)
    assert main(["replay", str(tmp_path / "t.npt"), "--policy", "torch,expandable,npu_pool", "--no-min-capacity"]) == 0
    assert steps == [0, 1, 2]  # one for each of the 3 replays (the first shown before it)
    seen: list[int] = []
    monkeypatch.setattr(memviz, "_BAR_EVENTS", 1)
    monkeypatch.setattr(ByteProgress, "to", lambda self, k: seen.append(k))
    assert main(["export", str(tmp_path / "t.npt"), "--policy", "npu_pool", "--out", str(tmp_path / "s.pickle")]) == 0
    assert seen == sorted(seen) and seen[0] == 16384 and seen[-1] >= 2 * n - 16384
    capsys.readouterr()


def test_outputs_check_refuses_sockets_and_loops_and_keeps_the_links(tmp_path: Path) -> None:
    """A loop of symbolic links passed and was replaced by a regular file (the links lost); a
    socket was taken for a FIFO nobody reads, after the work."""
    import socket

    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    with pytest.raises(OSError, match="loop1: cannot write .*symbolic links"):
        outputs.check(tmp_path / "loop1")
    with pytest.raises(OSError, match="loop1: cannot write"):
        outputs.write_text(tmp_path / "loop1", "x")
    assert (tmp_path / "loop1").is_symlink() and (tmp_path / "loop2").is_symlink()
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tmp_path / "sock"))
        with pytest.raises(OSError, match="sock: is a socket; name a file to write"):
            outputs.check(tmp_path / "sock")
    assert not list(tmp_path.rglob("*.partial"))


def test_strings_from_files_cannot_drive_the_terminal_or_forge_rows(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    """A snapshot's frame name reached analyze's Markdown raw: an OSC sequence retitled the
    terminal, a newline forged a table row, a <script> went to renderers that pass HTML, and a
    lone surrogate left nothing but a codec error. A rank report's mode did the same in merge."""
    name = "evil|col\n| forged | row |\n\x1b]0;PWNED\x07\x1b[31mRED\r<script>alert(1)</script>\u202e\ud800"
    events = [{"action": "alloc", "addr": 4096 * k, "size": 4096, "stream": 0,
               "frames": [{"filename": "/a/b.py", "name": name, "line": 1}]} for k in range(1, 5)]
    with open(tmp_path / "evil.pickle", "wb") as f:
        pickle.dump({"segments": [], "device_traces": [events]}, f)
    assert main(["analyze", str(tmp_path / "evil.pickle"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out and "<script>" not in out and "| forged |" not in out
    assert "\\x1b]0;PWNED" in out and "&lt;script>" in out and "\\ud800" in out
    # the HTML report too: a bidirectional override reached its page raw (a review of the reports)
    assert main(["analyze", str(tmp_path / "evil.pickle"), "--no-progress", "--format", "html",
                 "-o", str(tmp_path / "evil.html")]) == 0
    page = (tmp_path / "evil.html").read_text()
    assert "\u202e" not in page and "\x1b" not in page and "<script>alert" not in page
    assert "\\u202e" in page and "\\x1b]0;PWNED" in page
    t = small_trace(2)
    t.meta["origin"] = name
    t.save(tmp_path / "o.npt")
    assert main(["analyze", str(tmp_path / "o.npt"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "origin `evil|col\\x0a" in out  # (a code span: printable, no Markdown escapes)
    plan = make_plan(training(iters=3), "t")
    plan.meta["source"] = name
    save_plan(plan, tmp_path / "p.npplan")
    assert main(["plan", "--check", str(tmp_path / "p.npplan")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out and "trace         evil|col\\x0a" in out
    (tmp_path / "run").mkdir()
    for bad, why in (({"version": 1, "rank": 0, "mode": "\x1b[31mred\nforged"}, "mode should be device or recorder"),
                     ({"version": True, "rank": 0, "mode": "device"}, "not an npu_pool rank report of version 1")):
        (tmp_path / "run" / "npu_pool_rank0.json").write_text(json.dumps(bad))
        _one_line(capsys, ["merge", str(tmp_path / "run")], why)


def test_a_plan_whose_region_disagrees_with_its_figures_is_refused(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    """A plan rewritten with a 60 GiB region passed --check (which printed its meta's 0.1 GiB) and
    made the planned policy reserve 60 GiB for a 0.1 GiB job."""
    t = training(iters=3)
    plan = make_plan(t, "t")
    plan.region = 60 << 30
    save_plan(plan, tmp_path / "bloat.npplan")
    with pytest.raises(PlanError, match=r"a region of 64424509440 bytes where its figures say \d+"):
        load_plan(tmp_path / "bloat.npplan")
    _one_line(capsys, ["plan", "--check", str(tmp_path / "bloat.npplan")], "the file was edited or is corrupt")


def test_replay_says_when_a_given_plan_runs_online(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The 'runs online' note was printed only for a plan replay made itself; a --plan file whose
    planner found it worse than the online pool gave a 'planned' row that was npu_pool's, unsaid."""
    t = training(iters=3)
    t.save(tmp_path / "t.npt")
    plan = make_plan(t, "t")
    plan.meta["online"] = "worse on this trace"
    save_plan(plan, tmp_path / "p.npplan")
    assert main(["replay", str(tmp_path / "t.npt"), "--policy", "planned", "--plan", str(tmp_path / "p.npplan"),
                 "--no-min-capacity"]) == 0
    assert "planned on t: runs online (the plan worse on this trace)" in capsys.readouterr().out


def test_colocate_functions_name_a_pool_of_the_wrong_type() -> None:
    import npu_pool

    for call in (lambda: npu_pool.pause("t", pool=5), lambda: npu_pool.resume("t", pool="x"),
                 lambda: npu_pool.region("t", pool=[]), lambda: npu_pool.set_backup_limit(0, pool=1.5)):
        with pytest.raises(TypeError, match="pool must be an npu_pool.Pool"):
            call()


@pytest.mark.parametrize("out", ["/dev/stdout", "//dev/stdout", "/proc/$$/task/$$/fd/1"])
def test_out_dev_stdout_appended_to_a_file_keeps_what_was_there(tmp_path: Path, out: str) -> None:
    """/dev/stdout led to the regular file a shell's >> opened: the write renamed a new file over
    it, its earlier lines lost (rc 0); a thread's own fd path too (a review, 2026-11-27: the
    pattern of stream paths had left /proc/PID/task/TID/fd/N out)."""
    t = small_trace(2)
    t.save(tmp_path / "t.npt")
    log = tmp_path / "log.txt"
    log.write_text("precious line\n")
    with open(log, "a") as f:  # ($$: the shell's pid, python's after exec; its main thread's tid too)
        r = subprocess.run(["sh", "-c", f'exec "{sys.executable}" -m npu_pool.cli analyze "{tmp_path / "t.npt"}" '
                            f'--no-progress --out {out}'], stdout=f, stderr=subprocess.PIPE, text=True,
                           cwd=str(ROOT), timeout=120)
    assert r.returncode == 0, r.stderr
    text = log.read_text()
    assert text.startswith("precious line\n# Memory analysis:") and not list(tmp_path.glob(".*partial"))


@pytest.mark.skipif(not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK), reason="no writable /dev/shm")
def test_a_file_under_dev_is_replaced_whole_and_never_an_input(capsys: pytest.CaptureFixture) -> None:
    """Every path under /dev or /proc was taken for a stream: a file of /dev/shm (a tmpfs) given as
    --out was appended to (twice: two JSON documents in one file) and could be the command's own
    input (the trace, appended to itself, then refused as corrupt) (a review, 2026-11-27)."""
    folder = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        t = folder / "t.npt"
        small_trace(2).save(t)
        _one_line(capsys, ["analyze", str(t), "--no-progress", "-o", str(t)], "is also an input")
        assert len(Trace.load(t)) == len(small_trace(2))
        out = folder / "r.json"
        for _ in range(2):
            assert main(["analyze", str(t), "--no-progress", "--format", "json", "-o", str(out)]) == 0
        assert json.loads(out.read_text())["traces"]
    finally:
        shutil.rmtree(folder)


def test_errors_quoting_a_file_print_as_escapes_and_site_frames_stay_readable(tmp_path: Path,
                                                                              capsys: pytest.CaptureFixture) -> None:
    """An error quoting a plan's source printed its OSC sequence raw (stderr); and md_cell wrote
    the ' < ' between a site's frames as '&lt;'."""
    from npu_pool.units import md_cell

    assert md_cell("a.py:1:f < b.py:2:<module>") == "a.py:1:f < b.py:2:&lt;module>"
    # bidirectional overrides reorder the rest of the line on a terminal or page ("Trojan Source")
    assert md_cell("evil\u202eexe.py\u2066x") == "evil\\u202eexe.py\\u2066x"
    plan = make_plan(training(iters=3), "t")
    plan.meta["source"] = "x\x1b]0;PWNED\x07y"
    save_plan(plan, tmp_path / "p.npplan")
    other = small_trace(2)
    other.save(tmp_path / "o.npt")
    errors = sys.stderr.errors
    assert main(["plan", "--check", str(tmp_path / "p.npplan"), str(tmp_path / "o.npt")]) == 1
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\\x1b]0;PWNED" in err, err
    assert sys.stderr.errors == errors  # main put the stream back as it was


def test_probe_of_2026_11_26_second_snapshots_and_recorded_failures(tmp_path, capsys) -> None:
    """A second hostile-input probe (2026-11-26): each case raised a traceback, failed deep inside a
    command, or gave a wrong answer."""
    from npu_pool.trace.format import OP_OOM, OP_PAUSE, OP_REGION, OP_RESUME

    # a snapshot is held to a trace file's rules by every command (analyze and estimate raised
    # OverflowError, plan and replay torch's 'Overflow when unpacking long long', export wrote it)
    snap = tmp_path / "huge.pickle"
    snap.write_bytes(pickle.dumps({"segments": [], "device_traces": [[
        {"action": "alloc", "addr": 4096, "size": 1 << 63, "stream": 0, "frames": []}]]}))
    for argv in (["analyze", str(snap)], ["estimate", "--trace", str(snap)], ["plan", str(snap)],
                 ["replay", "--no-min-capacity", str(snap)], ["export", str(snap), "-o", str(tmp_path / "e.json")]):
        _one_line(capsys, argv, f"{snap}: device_traces[0][0].size is 9223372036854775808 bytes, more than any "
                  "device has (2^48)")
    assert not (tmp_path / "e.json").exists()
    # a request the validator takes that the device's padding puts past any device: planned as replayed
    edge = tmp_path / "edge.npt"
    t = small_trace(1, 1 << 48)
    t.meta["allocator_settings"] = {"device_type": "npu"}
    t.save(edge)
    for argv in (["plan", str(edge)], ["replay", "--policy", "planned", "--no-min-capacity", str(edge)]):
        _one_line(capsys, argv, "event 0 is a request of 256.00 TiB, more than the simulated 1 TiB device")
    # one iteration, then the next one's begin marker: nothing repeats, the whole trace is planned
    t = Trace(meta={"n_ids": 1})
    t.append(OP_MARK, cat=MARK_ITER_BEGIN, addr=0)
    t.append(OP_ALLOC, id=0, size=MiB)
    t.append(OP_FREE, id=0, size=MiB)
    t.append(OP_MARK, cat=MARK_ITER_BEGIN, addr=1)
    assert make_plan(t, "cut").meta["method"] == "whole"
    # recorded failures: an entry must be an oom event of its size, its free bytes a device's
    def with_ooms(name: str, events: list[tuple], ooms: list[dict]) -> str:
        t = Trace(meta={"n_ids": sum(op == OP_ALLOC for op, _ in events), "ooms": ooms})
        for op, kw in events:
            t.append(op, **kw)
        t.save(tmp_path / name)
        return str(tmp_path / name)

    events = [(OP_ALLOC, dict(id=0, size=MiB)), (OP_OOM, dict(size=4 * MiB)), (OP_FREE, dict(id=0, size=MiB))]
    for ooms, words in [([{"event": 0, "size": 4 * MiB}], "entry 0: event 0 is not a failed request"),
                        ([{"event": 99, "size": 4 * MiB}], "entry 0: event 99 is not a failed request"),
                        ([{"event": 1, "size": MiB}], "entry 0: event 1 is not a failed request (an oom event) of 1048576"),
                        ([{"event": 1, "size": 4 * MiB, "device_free": 300 << 40}], "more than any device has")]:
        for command in ("analyze", "replay"):
            _one_line(capsys, [command, with_ooms("o.npt", events, ooms)], "meta['ooms']", words)
    assert main(["analyze", with_ooms("ok.npt", events, [{"event": 1, "size": 4 * MiB, "device_free": 0}])]) == 0
    assert "1 request(s) failed" in capsys.readouterr().out
    # a failed request inside a paused region: refused like an allocation there (npu_pool's replay
    # stopped on it while the torch model's went on)
    paused = [(OP_PAUSE, dict(id=0)), (OP_REGION, dict(id=0)), (OP_OOM, dict(size=MiB)), (OP_REGION, dict(id=-1)),
              (OP_RESUME, dict(id=0))]
    path = with_ooms("p.npt", paused, [{"event": 2, "size": MiB}])
    for command in ("analyze", "replay"):
        _one_line(capsys, [command, path], "event 2: oom inside region 0, which is paused")
    # a snapshot's failed request whose free bytes no device has: named where it is
    snap.write_bytes(pickle.dumps({"segments": [], "device_traces": [[
        {"action": "oom", "size": MiB, "device_free": (1 << 63) + 5, "stream": 0, "frames": []}]]}))
    _one_line(capsys, ["import", "--out", str(tmp_path / "imp"), str(snap)], "device_free is 9223372036854775813 bytes",
              "more than any device has")


def test_an_option_given_an_empty_value_is_refused(tmp_path, capsys) -> None:
    """`--out "$UNSET"`: import wrote into the current folder, capture trained and dropped its
    trace, --json, --plan, --costs and analyze's -o fell back to their defaults, export said
    '.: is a directory'."""
    trace = tmp_path / "a.npt"
    small_trace().save(trace)
    for argv, option in [(["import", "--out", "", str(trace)], "--out"), (["import", "--out=", str(trace)], "--out"),
                         (["capture", "--out", ""], "--out/-o"), (["replay", str(trace), "--json", ""], "--json"),
                         (["replay", str(trace), "--costs", ""], "--costs"),
                         (["replay", str(trace), "--policy", "planned", "--plan", ""], "--plan"),
                         (["analyze", "--format", "html", "-o", "", str(trace)], "--out/-o"),
                         (["export", str(trace), "-o", ""], "--out/-o"),
                         (["import", "--ou", "", str(trace)], "--out"),  # (abbreviated, as argparse allows)
                         (["estimate", "--dtype", ""], "--dtype"),  # (an option of an argument group)
                         (["replay", "", str(trace)], "TRACE")]:
        _one_line(capsys, argv, f"argument {option}: an empty value (an unset variable?)")
    _one_line(capsys, ["replay", str(trace), "--policy", "torch,"], "the policy list 'torch,' has an empty name",
              code=2)
    with pytest.raises(SystemExit):  # argparse's line: a whole number is ASCII digits, as in settings
        main(["capture", "--steps", "\u0663", "--out", str(tmp_path / "c.npt")])
    assert "expected a whole number, not '\u0663'" in capsys.readouterr().err
    t = small_trace()
    t.meta["expandable_segments"] = "no"  # not false: would have read as true
    t.save(tmp_path / "x.npt")
    _one_line(capsys, ["replay", "--validate", str(tmp_path / "x.npt")], "meta['expandable_segments'] is 'no'")
    t = small_trace()
    t.meta["device_type"] = "tpu"  # a runtime of none of ours: replays applied CUDA's rules, saying nothing
    t.save(tmp_path / "x.npt")
    _one_line(capsys, ["replay", str(tmp_path / "x.npt"), "--policy", "torch"], "meta['device_type'] is 'tpu'")
    assert not list(Path.cwd().glob("a.dev*.npt")) and sorted(p.name for p in tmp_path.iterdir()) == ["a.npt", "x.npt"]


def test_the_parsers_refusal_of_empty_values_reaches_groups_and_spares_empty_defaults() -> None:
    from npu_pool.cli import _EmptyValue, _Parser

    p = _Parser(prog="x")
    p.add_argument("--keep", default="")  # "" is its default: an absent option is not refused
    p.add_argument_group("g").add_argument("--n", type=int)
    p.add_mutually_exclusive_group().add_argument("--m")
    assert vars(p.parse_args([])) == {"keep": "", "n": None, "m": None}
    for argv in (["--n", ""], ["--m="]):
        with pytest.raises(_EmptyValue):
            p.parse_args(argv)


def test_analyze_refuses_one_trace_given_twice(tmp_path, capsys) -> None:
    """A snapshot imported into its own folder: each rank was listed twice and compared with itself
    ('min on run.dev0, max on run.dev0')."""
    small_trace().save(tmp_path / "run.npt")
    (tmp_path / "sub").mkdir()
    small_trace(8).save(tmp_path / "sub" / "run.npt")
    (tmp_path / "run.pickle").write_bytes(pickle.dumps({"segments": [], "device_traces": [[
        {"action": "alloc", "addr": 4096, "size": 512, "stream": 0, "frames": []}]]}))  # beside run.npt: the same
    _one_line(capsys, ["analyze", str(tmp_path)], "both hold the trace run: analyze one of them")
    (tmp_path / "run.pickle").unlink()
    # two folders' traces of one name are two runs: both analysed, told apart by their folder
    assert main(["analyze", str(tmp_path / "run.npt"), str(tmp_path / "sub" / "run.npt")]) == 0
    assert "sub/run" in capsys.readouterr().out


def test_probe_of_2026_11_27_each_mistake_is_one_line(tmp_path, capsys) -> None:
    """A hostile-input review (2026-11-27, a helper) found, each reproduced: a traceback from
    `analyze --format html` of any snapshot repaired on import (html.py never imported
    repairs_said); an OverflowError from `analyze` on a small valid trace whose requests of up to
    2^48 bytes add up past 64 bits live; sizes of snapshot segments no device has imported (a
    recorded peak of 3e10 GiB); and a plan of no positions refused as a region not a multiple of
    512."""
    e = lambda a: {"action": a, "addr": 1 << 20, "size": 512, "stream": 0, "time_us": 1, "frames": []}  # noqa: E731
    repaired = tmp_path / "rep.pickle"
    repaired.write_bytes(pickle.dumps({"segments": [], "device_traces": [[e("alloc"), e("alloc"), e("free_completed")]]}))
    assert main(["analyze", str(repaired), "--format", "html", "-o", str(tmp_path / "rep.html")]) == 0
    assert "repaired on import (1)" in (tmp_path / "rep.html").read_text()
    capsys.readouterr()
    # the bytes live at once: 2^48 at most, as each request (every sum of them then fits)
    t = Trace(meta={"n_ids": 3})
    for i in range(3):
        t.append(OP_ALLOC, id=i, size=1 << 47)
    t.save(tmp_path / "huge.npt")
    for command in ("analyze", "replay"):
        _one_line(capsys, [command, str(tmp_path / "huge.npt")], "event 2: 422212465065984 bytes live at once",
                  "more than any device has (2^48)")
    # a snapshot's sizes past 2^48: an event's, an end-state segment's, a block's
    seg = dict(e("segment_alloc"), size=1 << 62)
    for snap, where in [({"segments": [], "device_traces": [[seg]]}, "device_traces[0][0].size"),
                        ({"segments": [{"address": 0, "total_size": 1 << 62, "blocks": []}],
                          "device_traces": [[e("alloc")]]}, "segments[0].total_size"),
                        ({"segments": [{"address": 0, "total_size": 1 << 21, "blocks": [
                            {"address": 0, "size": 1 << 49, "state": "active_allocated"}]}],
                          "device_traces": [[e("alloc")]]}, "segments[0].blocks[0].size")]:
        (tmp_path / "seg.pickle").write_bytes(pickle.dumps(snap))
        _one_line(capsys, ["import", "--out", str(tmp_path / "imp"), str(tmp_path / "seg.pickle")], where,
                  "bytes, more than any device has (2^48)")
    # a plan of no positions
    plan = make_plan(training(iters=3), "t")
    plan.size, plan.offset, plan.end, plan.loop = array.array("Q"), array.array("Q"), array.array("Q"), 0
    save_plan(plan, tmp_path / "empty.npplan")
    _one_line(capsys, ["plan", "--check", str(tmp_path / "empty.npplan")], "plan: no positions")


def test_a_snapshot_too_large_for_free_memory_is_said_so_without_a_second_read(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of memory in the streamed read: the whole read, which needs 3-9x more, was tried next, and its
    message blamed the file ("corrupt or hostile") for a valid snapshot too large for the machine (a review,
    a helper: a 43 MB snapshot under a 52 MB address-space limit). The CLI's handler, which printed while
    the failed read's frames still held that memory, lost its stderr on a small hostile file."""
    import weakref

    from npu_pool.trace import snapshot

    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[]]}))
    held = []

    class Big:
        pass

    def streamed(*_a: object, **_k: object) -> None:
        big = Big()  # what the read holds when memory runs out, freed before the message is printed
        held.append(weakref.ref(big))
        raise MemoryError

    def whole(*_a: object) -> None:
        raise AssertionError("read whole after running out of memory")

    monkeypatch.setattr(snapshot, "_streamed", streamed)
    monkeypatch.setattr(snapshot, "_unpickle", whole)
    with pytest.raises(TraceError, match=r"out of memory reading it \(\d+ bytes\): this machine has too little free"):
        load_snapshot(path)
    real_print = print
    alive = []

    def printing(*a: object, **kw: object) -> None:
        alive.append(held[-1]() is not None)
        real_print(*a, **kw)

    monkeypatch.setattr(snapshot, "_streamed", streamed)
    monkeypatch.setattr("builtins.print", printing)
    assert main(["import", str(path), "--out", str(tmp_path / "o")]) == 1
    monkeypatch.setattr("builtins.print", real_print)
    assert "out of memory reading it" in capsys.readouterr().err and alive == [False]


def test_one_block_listed_a_million_times_is_refused_before_it_costs_a_record_each(tmp_path: Path) -> None:
    """A segment listing one block object again and again (a memo reference: two bytes of the file each)
    cost a checked record each: a 5 MB file took 543 MB to import (a review, a helper). A block, and a
    segment, is one object listed once."""
    block = dict(address=1 << 41, size=512, requested_size=512, state="inactive", frames=[])
    alloc = dict(action="alloc", addr=1 << 40, size=512, stream=0, time_us=1, frames=[])
    seg = dict(device=0, address=1 << 41, total_size=2 << 20, stream=0, segment_type="small", blocks=[block] * 10**6)
    path = tmp_path / "blocks.pickle"
    path.write_bytes(pickle.dumps(dict(segments=[seg], device_traces=[[alloc]]), 4))
    tracemalloc.start()
    try:
        with pytest.raises(TraceError, match=r"segments\[0\]\.blocks\[1\] is a block listed before"):
            load_snapshot(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 * path.stat().st_size  # the unpickled list of references, not a record per reference
    seg2 = dict(seg, blocks=[block])
    path.write_bytes(pickle.dumps(dict(segments=[seg2] * 3, device_traces=[[alloc]]), 4))
    with pytest.raises(TraceError, match=r"segments\[1\] is a segment listed before"):
        load_snapshot(path)
