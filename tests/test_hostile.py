"""Hostile input: files crafted to hang, exhaust memory or crash the tools, numbers outside 64
bits, plans for another trace. Each is refused within seconds with one line naming the file
and the problem (no traceback), or accepted only when valid."""
from __future__ import annotations

import json
import pickle
import struct
import sys
import time
from pathlib import Path

import pytest

from npu_pool import vocab
from npu_pool.cli import main
from npu_pool.planner import PlanError, make_plan, save_plan
from npu_pool.planner.planfile import MAGIC as PLAN_MAGIC, plan_bytes
from npu_pool.pool import InvalidArgumentError, Pool
from npu_pool.trace.format import MAGIC, OP_ALLOC, OP_FREE, OP_INIT_ALLOC, Trace, TraceError
from npu_pool.trace.snapshot import load_snapshot
from test_planner import training

MiB = 1 << 20


def _refused(capsys: pytest.CaptureFixture, argv: list[str], *words: str, seconds: float = 10.0,
             code: int = 1) -> str:
    """Run the CLI; it must fail fast with one line on stderr that names the file and the problem
    (``code``: 2 for a mistake in the command line itself)."""
    t0 = time.perf_counter()
    assert main(argv) == code
    assert time.perf_counter() - t0 < seconds
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for w in words:
        assert w in err, err
    return err


def _npt(path: Path, header: dict, body: bytes = b"") -> Path:
    h = json.dumps(header).encode()
    path.write_bytes(MAGIC + struct.pack("<Q", len(h)) + h + body)
    return path


def small_trace(n: int = 4, size: int = MiB) -> Trace:
    """``n`` allocations of ``size`` bytes, all live at once, then their frees."""
    t = Trace(meta={"n_ids": n, "sites": ["model.py:1:f"]})
    for i in range(n):
        t.append(OP_ALLOC, id=i, size=size, site=0)
    for i in range(n):
        t.append(OP_FREE, id=i, size=size, site=0)
    return t


# ---- snapshots -------------------------------------------------------------------------------------

def test_settings_of_shared_dicts_nested_40_deep_import_at_once(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    d: dict = {"x": 1}
    for _ in range(40):
        d = {"a": d, "b": d}  # 2^40 paths through a few hundred bytes
    snap = {"device_traces": [[{"action": "alloc", "addr": 4096, "size": 512, "stream": 0}]], "segments": [],
            "allocator_settings": d}
    path = tmp_path / "bomb.pickle"
    path.write_bytes(pickle.dumps(snap))
    assert path.stat().st_size < 2000
    t0 = time.perf_counter()
    (t,) = load_snapshot(path)
    assert time.perf_counter() - t0 < 5
    assert len(json.dumps(t.meta)) < 100_000  # a bounded copy of the settings
    assert main(["import", str(path), "--out", str(tmp_path / "o")]) == 0


def _deep_dict_pickle(depth: int, inner: bytes = b"}") -> bytes:
    """Pickle opcodes of {"k": {"k": ... inner ...}} nested ``depth`` deep (pickle.dumps recurses and cannot)."""
    return b"}\x8c\x01k" * depth + inner + b"s" * depth


def test_a_100000_deep_nested_dict_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "deep.pickle"
    path.write_bytes(b"\x80\x04" + _deep_dict_pickle(100_000) + b".")
    _refused(capsys, ["import", str(path), "--out", str(tmp_path / "o")], "deep.pickle")
    # the same depth inside what is read: the settings of a snapshot
    snap = pickle.dumps({"device_traces": [[{"action": "alloc", "addr": 4096, "size": 512, "stream": 0}]],
                         "allocator_settings": "SENTINEL"}, protocol=2)
    sentinel = b"X\x08\x00\x00\x00SENTINEL"
    assert snap.count(sentinel) == 1
    path.write_bytes(snap.replace(sentinel, _deep_dict_pickle(100_000)))
    (t,) = load_snapshot(path)
    assert "..." in json.dumps(t.meta["allocator_settings"])


def test_a_snapshot_repeating_one_event_list_beyond_its_size_is_refused(tmp_path: Path) -> None:
    events = [{"action": "alloc", "addr": 4096 * (i + 1), "size": 512, "stream": 0} for i in range(1000)]
    snap = {"device_traces": [events] * 5000}  # 5 million events referenced from a ~100 kB file
    path = tmp_path / "refs.pickle"
    path.write_bytes(pickle.dumps(snap))
    with pytest.raises(TraceError, match="references .* events, segments and blocks in .* bytes"):
        load_snapshot(path)


def test_a_pickle_with_code_is_refused_unexecuted(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "evil.pickle"
    path.write_bytes(b"cos\nsystem\n(S'touch " + str(tmp_path / "pwned").encode() + b"'\ntR.")
    _refused(capsys, ["import", str(path), "--out", str(tmp_path / "o")], "evil.pickle", "os.system")
    assert not (tmp_path / "pwned").exists()


# ---- traces ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("header, body, words", [
    ({"meta": {"n_ids": 1}, "n": 1 << 62}, b"", ["4611686018427387904 events", "truncated or corrupt"]),
    ({"meta": {"n_ids": 10**12}, "n": 0}, b"", ["n_ids", "1000000000000"]),
    ({"meta": {}, "n": 0, "byteorder": "big"}, b"", ["byte order 'big'", "little-endian"]),
    ({"meta": {}, "n": 0, "columns": ["op", "size"]}, b"", ["columns", "this npu_pool reads"]),
    ({"meta": [], "n": 0}, b"", ["meta is a list"]),
    ({"n": "many"}, b"", ["corrupt header"]),
])
def test_corrupt_trace_headers_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture, header: dict, body: bytes,
                                           words: list) -> None:
    path = _npt(tmp_path / "h.npt", header, body)
    _refused(capsys, ["analyze", str(path)], "h.npt", *words)


@pytest.mark.parametrize("column, value, words", [
    ("site", 10**9, ["site 1000000000 indexes none of the 1 sites"]),
    ("cat", 200, ["unknown tensor category 200"]),
    ("size", 1 << 60, ["alloc of 1152921504606846976 bytes"]),
    ("size", 0, ["alloc of 0 bytes"]),
])
def test_bad_event_values_are_refused_before_anything_is_sized_by_them(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture,
                                                                        column: str, value: int, words: list) -> None:
    t = small_trace()
    getattr(t, column)[1] = value
    t.save(tmp_path / "bad.npt")
    t0 = time.perf_counter()
    _refused(capsys, ["analyze", str(tmp_path / "bad.npt")], "bad.npt", "event 1", *words)
    _refused(capsys, ["replay", str(tmp_path / "bad.npt"), "--no-min-capacity"], "bad.npt", "event 1")
    assert time.perf_counter() - t0 < 10


def test_files_that_are_no_trace_say_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "x.npt").write_bytes(b"NOTATRACE" + b"\0" * 40)
    _refused(capsys, ["analyze", str(tmp_path / "x.npt")], "x.npt", "not an npu_pool trace (bad magic)")
    (tmp_path / "x.txt").write_text("hello")
    err = _refused(capsys, ["analyze", str(tmp_path / "x.txt")], "x.txt", "neither an npu_pool trace")
    assert "pickle" not in err.split(":", 1)[1].split("(")[0]
    plan = make_plan(training(iters=3))
    save_plan(plan, tmp_path / "p.npplan")
    _refused(capsys, ["analyze", str(tmp_path / "p.npplan")], "p.npplan", "an npu_pool plan")


# ---- plans -----------------------------------------------------------------------------------------

def _plan_file(path: Path, **header_changes: object) -> Path:
    data = bytearray(plan_bytes(make_plan(training(iters=3))))
    (hlen,) = struct.unpack_from("<Q", data, 16)
    head = json.loads(bytes(data[24:24 + hlen]))
    head.update(header_changes)
    h = json.dumps(head).encode()
    body = struct.pack("<Q", len(h)) + h + bytes(data[24 + hlen:])
    import zlib

    path.write_bytes(PLAN_MAGIC + struct.pack("<II", 1, zlib.crc32(body)) + body)
    return path


@pytest.mark.parametrize("change, words", [
    ({"flags": 1 << 70}, ["flags is", f"0..{vocab.PLAN_FLAGS}"]),
    ({"loop": -1}, ["loop is -1"]),
    ({"region": 1 << 60}, ["region is"]),
    ({"meta": [1, 2]}, ["meta is a list"]),
])
def test_corrupt_plan_headers_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture, change: dict,
                                          words: list) -> None:
    t = training(iters=3)
    t.save(tmp_path / "t.npt")
    path = _plan_file(tmp_path / "bad.npplan", **change)
    _refused(capsys, ["replay", str(tmp_path / "t.npt"), "--policy", "planned", "--plan", str(path),
                      "--no-min-capacity"], "bad.npplan", *words)


def test_a_plan_made_for_another_trace_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    save_plan(make_plan(training(iters=3)), tmp_path / "p.npplan")
    other = small_trace(8)
    other.save(tmp_path / "other.npt")
    _refused(capsys, ["replay", str(tmp_path / "other.npt"), "--policy", "planned", "--plan",
                      str(tmp_path / "p.npplan"), "--no-min-capacity"], "made for", "never runs")
    from npu_pool import replay

    with pytest.raises(PlanError, match="never runs"):
        replay.run(other, "planned", plan=tmp_path / "p.npplan")
    longer = training(iters=5, eval_after=1)  # the same iteration, run more often and with an evaluation
    assert replay.run(longer, "planned", plan=tmp_path / "p.npplan").ok


# ---- numbers outside 64 bits -----------------------------------------------------------------------

def test_numbers_outside_64_bits_are_invalid_arguments() -> None:
    with Pool("npu_pool", capacity=1 << 30) as p:
        ptr = p.malloc(4096)
        with pytest.raises(InvalidArgumentError, match="pointer"):
            p.free((1 << 64) + ptr)  # never frees ptr by wrapping around
        assert p.stats()["total"]["allocated"]["current"] == 4096
        for call in (lambda: p.malloc(1 << 70), lambda: p.malloc(4096, stream=1 << 70), lambda: p.malloc(-1),
                     lambda: p.malloc(4096, site=1 << 40), lambda: p.record_stream(ptr, -(1 << 70)),
                     lambda: p.block_size(-1), lambda: p.mark("forward_begin", 1 << 64),
                     lambda: p.set_history(1 << 65), lambda: p.malloc(4096.0)):  # type: ignore[arg-type]
            with pytest.raises(InvalidArgumentError):
                call()
        p.free(ptr)
    for kwargs in ({"capacity": 1 << 70}, {"capacity": -1}, {"capacity": 1 << 50}, {"max_split_size": 1 << 70},
                   {"fraction": "most"}, {"fraction": 10 ** 400}, {"device": 64}, {"lib_path": "/x"}):
        with pytest.raises(InvalidArgumentError):  # (10**400: an OverflowError; device 2**21: a 4 MB OOM snapshot)
            Pool("torch", **kwargs)  # type: ignore[arg-type]


def test_reset_peak_starts_every_peak_at_its_current_value() -> None:
    """The arena's high-water mark is computed when read: reset_peak set its peak to 0, below it."""
    with Pool("npu_pool", capacity=1 << 30) as p:
        ptr = p.malloc(5 * MiB)
        p.reset_peak()
        hwm = p.stats()["arena_hwm"]
        assert hwm["peak"] == hwm["current"] >= 5 * MiB
        p.free(ptr)
    with Pool("npu_pool", capacity=1 << 30, vmm=False) as p:  # a fixed arena: empty_cache gives it back whole
        p.free(p.malloc(100 * MiB))
        p.empty_cache()
        p.reset_peak()
        assert p.stats()["arena_hwm"]["peak"] == p.stats()["arena_hwm"]["current"] == 0
    with Pool("npu_pool", capacity=1 << 30) as p:  # a tag's arena is not the main arena: its top is no hwm
        big = p.malloc(100 * MiB)
        with p.region("t"):
            t = p.malloc(MiB)
        p.free(big)
        p.empty_cache()
        p.reset_peak()
        with p.region("t"):
            u = p.malloc(MiB)
        hwm = p.stats()["arena_hwm"]
        assert hwm["peak"] == hwm["current"] < 100 * MiB
        p.free(t), p.free(u)


def test_the_arenas_high_water_mark_never_reads_above_its_peak() -> None:
    """A fixed arena given back whole (empty_cache) came back without its high-water mark's
    accounting: its peak stayed 12 MiB while its current read 34 MiB; a pool used only inside a
    region reported the tag arena's top as the main arena's current, above its peak of 0 (a review
    fuzzing the core, 2026-11-27)."""
    with Pool("npu_pool", capacity=1 << 30) as p:
        with p.region("a"):
            p.malloc(25 * MiB)
        hwm = p.stats()["arena_hwm"]
        assert hwm["current"] == hwm["peak"] == 0, hwm
    with Pool("npu_pool", capacity=1 << 30, vmm=False) as p:
        p.free(p.malloc(12 * MiB))
        p.empty_cache()
        p.malloc(34 * MiB)
        hwm = p.stats()["arena_hwm"]
        assert hwm["peak"] >= hwm["current"] >= 34 * MiB, hwm


@pytest.mark.parametrize("policy", ["npu_pool", "torch", "expandable"])
def test_the_pools_own_stream_tags_are_no_callers_stream(policy: str) -> None:
    """The two lowest 64-bit values tag free memory (any stream; several): a block allocated on
    the first, or recorded on it, was reused on another stream with no wait (a helper's review),
    and a trace carrying one replayed so. Refused, and the books stay as they were."""
    with Pool(policy, capacity=1 << 30) as p:
        ptr = p.malloc(4096, stream=5)
        before = p.stats()
        for stream in (-(1 << 63), 1 - (1 << 63)):
            with pytest.raises(InvalidArgumentError, match="reserved"):
                p.malloc(4096, stream=stream)
            with pytest.raises(InvalidArgumentError, match="reserved"):
                p.record_stream(ptr, stream)
        assert p.stats()["total"] == before["total"]
        assert p.malloc(4096, stream=2 - (1 << 63)) != 0  # the next value is a stream like any other
        p.free(ptr)
        p.check()


# ---- the trace's ordering rules, and options a user mistypes -------------------------------------

def test_a_trace_with_a_reserved_stream_is_refused_naming_the_event(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    """An .npt trace's stream of -2^63 (the core's tag of free memory any stream may take) reached
    the replay, which failed with the core's message naming neither the file nor the event."""
    t = Trace(meta={"n_ids": 1, "sites": []})
    t.append(OP_ALLOC, id=0, size=MiB, stream=-(1 << 63))
    t.append(OP_FREE, id=0, size=MiB, stream=-(1 << 63))
    t.save(tmp_path / "tag.npt")
    _refused(capsys, ["replay", str(tmp_path / "tag.npt"), "--no-min-capacity"], "tag.npt", "event 0",
             "stream -9223372036854775808, a value npu_pool reserves")


def test_an_initial_event_inside_the_window_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """init_* events come first (docs/trace_format.md): one after an alloc is named, not replayed."""
    t = Trace(meta={"n_ids": 2, "sites": []})
    t.append(OP_ALLOC, id=0, size=MiB)
    t.append(OP_INIT_ALLOC, id=1, size=MiB, addr=1 << 30)
    t.save(tmp_path / "late.npt")
    _refused(capsys, ["replay", str(tmp_path / "late.npt"), "--no-min-capacity"], "late.npt", "event 1",
             "init_alloc after the window began (event 0)")


def test_a_free_of_another_size_than_its_alloc_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A free copies its alloc's size: another size would make the peak live bytes (the lower bound
    every figure is measured against) silently wrong."""
    t = small_trace()
    t.size[4] = 2 * MiB  # event 4: the free of id 0
    t.save(tmp_path / "bad.npt")
    _refused(capsys, ["analyze", str(tmp_path / "bad.npt")], "bad.npt", "event 4",
             "free of id 0 with size 2097152; its alloc (event 0) has 1048576")


@pytest.mark.parametrize("argv, words", [
    (["capture", "--heads", "-1"], "argument --heads: must be >= 1, not -1"),
    (["capture", "--vocab", "0"], "argument --vocab: must be >= 1, not 0"),
    (["capture", "--layers", "-1"], "argument --layers: must be >= 1"),
    (["capture", "--steps", "two"], "argument --steps: expected a whole number, not 'two'"),
    (["capture", "--colocated", "-2"], "argument --colocated: must be >= 1"),
    (["capture", "--colocated", "0"], "argument --colocated: must be >= 1"),
    (["analyze", "x.npt", "--top", "-1"], "argument --top: must be >= 0, not -1"),
])
def test_counts_out_of_range_are_usage_errors(capsys: pytest.CaptureFixture, argv: list, words: str) -> None:
    """A count below its least value is refused by the parser in one line (before: a 0 or negative
    size fell back to the default, became a slice, or failed inside the model as a traceback)."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and words in err, err


@pytest.mark.parametrize("flag", ["--tp", "--pp"])
def test_a_real_capture_refuses_parallel_degrees(capsys: pytest.CaptureFixture, flag: str) -> None:
    """--tp and --pp slice a published shape; a real capture trains the small model whole (before:
    they were ignored, and the trace was the same as without them)."""
    assert main(["capture", flag, "2", "--steps", "1", "--no-progress"]) == 2
    assert "--tp and --pp slice a published shape: give --shape" in capsys.readouterr().err


def test_a_fake_capture_with_more_stages_than_layers_is_refused(capsys: pytest.CaptureFixture) -> None:
    _refused(capsys, ["capture", "--fake", "--shape", "7b", "--pp", "1000", "--no-progress"],
             "pp=1000 stages for the 32 layers")


def test_replay_refuses_a_plan_no_policy_replays(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    small_trace().save(tmp_path / "t.npt")
    _refused(capsys, ["replay", str(tmp_path / "t.npt"), "--policy", "npu_pool", "--plan", str(tmp_path / "no.npplan")],
             "--plan is the plan policy planned replays", code=2)
    _refused(capsys, ["replay", str(tmp_path / "t.npt"), "--policy", "npu_pool,planned", "--no-min-capacity",
                      "--plan", str(tmp_path / "no.npplan")], "no.npplan", "cannot read")


def test_a_protocol_0_snapshot_is_read_by_every_command(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`import` read old-protocol pickles and replay/analyze refused them: now all read a .pickle."""
    snap = {"device_traces": [[{"action": "alloc", "addr": 4096, "size": 512, "stream": 0, "frames": []},
                               {"action": "free_completed", "addr": 4096, "size": 512, "stream": 0, "frames": []}]]}
    (tmp_path / "p0.pickle").write_bytes(pickle.dumps(snap, protocol=0))
    assert main(["replay", str(tmp_path / "p0.pickle"), "--no-min-capacity"]) == 0
    assert main(["analyze", str(tmp_path / "p0.pickle")]) == 0
    assert main(["import", str(tmp_path / "p0.pickle"), "--out", str(tmp_path / "out")]) == 0
    (tmp_path / "junk.pickle").write_text("hello")
    _refused(capsys, ["replay", str(tmp_path / "junk.pickle")], "junk.pickle", "not a valid pickle")


def test_a_cost_table_nested_too_deeply_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    small_trace().save(tmp_path / "t.npt")
    (tmp_path / "c.json").write_text("[" * 100000)
    _refused(capsys, ["replay", str(tmp_path / "t.npt"), "--no-min-capacity", "--costs", str(tmp_path / "c.json")],
             "cost table", "c.json")


def test_import_names_the_snapshot_of_a_bad_event(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    snap = {"device_traces": [[{"action": "alloc", "addr": 4096, "size": 0, "stream": 0, "frames": []}]]}
    (tmp_path / "zero.pickle").write_bytes(pickle.dumps(snap))
    _refused(capsys, ["import", str(tmp_path / "zero.pickle"), "--out", str(tmp_path / "out")],
             "zero.pickle (device 0)", "alloc of 0 bytes")


# ---- a probe of the Python API and the environment (2026-11-26) -------------------------------

def test_a_pool_cannot_be_copied() -> None:
    """copy.copy(pool) made two objects own one context: the second to go freed it again (a double
    free: abort under -X dev, a hang at exit otherwise)."""
    import copy

    with Pool(capacity=1 << 30) as p:
        for make in (copy.copy, copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError, match="a Pool cannot be copied"):
                make(p)
        p.free(p.malloc(MiB))  # still its own


def test_trace_columns_of_another_element_type_are_refused() -> None:
    """validate() compared lengths only and handed the buffer to C as 64-bit values: an array('I')
    size column was read past its end (a segfault past an unreadable page), a list raised a bare
    TypeError."""
    import array

    t = Trace(meta={"n_ids": 1})
    t.append(OP_ALLOC, id=0, size=512)
    t.validate()
    for bad, said in ((array.array("I", [512]), "holds I items of 4 bytes"), ([512], "is a list"),
                      (array.array("q", [512]), "holds q items of 8 bytes")):
        t.size = bad
        with pytest.raises(TraceError, match=f"trace: column 'size' {said}"):
            t.validate()
    np = pytest.importorskip("numpy")
    t.size = np.array([512], dtype="<u8" if sys.byteorder == "little" else ">u8")
    t.validate()  # numpy of the same width, sign and byte order: taken as it is
    t.size = np.array([512], dtype=">u8" if sys.byteorder == "little" else "<u8")  # read byte-swapped by C
    with pytest.raises(TraceError, match="column 'size' holds .u8|column 'size' holds [<>]Q"):
        t.validate()
    t.size = array.array("Q", [512])
    t.append(OP_FREE, id=0, size=512)
    t.size = np.array([512, 0, 512, 0], dtype=np.uint64)[::2]  # two items, every other one of four
    with pytest.raises(TraceError, match="column 'size' is not one contiguous row"):
        t.validate()


def test_tags_under_threads_and_tag_names() -> None:
    """tags() read past its buffer when another thread made a tag between its two core calls (a
    bare IndexError, 1-25 a run); a NUL in a tag name was cut there ('a\\0b' was tag 'a')."""
    import threading

    with Pool(capacity=4 << 30) as p:
        errors: list[BaseException] = []
        done = threading.Event()

        def make() -> None:
            for i in range(32):
                with p.region(f"tag{i}"):
                    p.malloc(512)
            done.set()

        def read() -> None:
            while not done.is_set():
                try:
                    p.tags()
                except BaseException as e:  # noqa: BLE001 - any failure is the finding
                    errors.append(e)

        threads = [threading.Thread(target=read) for _ in range(3)] + [threading.Thread(target=make)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and len(p.tags()) == 32
        with pytest.raises(InvalidArgumentError, match="holds a NUL character"):
            p.region("a\0b")
        with pytest.raises(InvalidArgumentError, match="holds a NUL character"):
            p.pause("tag0\0x")
        with pytest.raises(InvalidArgumentError, match="backup must be True or False"):
            p.pause("tag0", backup="no")


def test_recorder_refuses_a_bad_marker_before_it_changes_anything() -> None:
    """A marker argument the pools refuse (2**70) was kept as the micro-batch first, so every later
    forward phase failed; a closed pool left the recorder claiming a phase open; step('3'),
    layer(None) raised a bare TypeError; exiting a phase never entered an IndexError; pools that
    are not pools an AttributeError at the first marker."""
    from npu_pool.recorder import Recorder

    pool = Pool(capacity=1 << 30)
    r = Recorder([pool])
    for bad in (lambda: r.mark("forward_begin", 2 ** 70), lambda: r.step("3"), lambda: r.layer(None),
                lambda: r.mark("iter_begin", "a")):
        with pytest.raises(ValueError, match="a marker argument is an int of 64 bits"):
            bad()
    with r.phase("forward"):
        pass
    assert r.state.marks == 2 and r.state.stage is None
    with pytest.raises(RuntimeError, match="exited without being entered"):
        r.phase("backward").__exit__(None, None, None)
    import numpy as np

    with r.phase("forward", np.int64(3)):  # numpy's integers are integers
        assert r.state.micro == 3
    pool.close()
    with pytest.raises(Exception, match="closed pool"):
        r.mark("forward_begin")
    forward = r.phase("forward")
    with pytest.raises(Exception, match="closed pool"):
        forward.__enter__()
    with pytest.raises(RuntimeError, match="exited without being entered"):  # the refused begin left nothing
        forward.__exit__(None, None, None)
    assert r.state.marks == 4 and r.state.stage is None
    with pytest.raises(TypeError, match="pools are npu_pool Pool objects"):
        Recorder([5])


def test_api_arguments_of_the_wrong_kind_are_named() -> None:
    """A fraction whose cap is 0 bytes (1e-300) was taken and every allocation then failed;
    lib_path as bytes raised AttributeError and one with a NUL was cut; set_fraction(device=[0])
    raised 'unhashable type'; oom.explain(pool, 'x') a bare int() error and -1 'request -1 B';
    history(limit=19634136210), then the largest bound, a MemoryError with no message."""
    from npu_pool import oom
    from npu_pool.vocab import HISTORY_MAX
    from npu_pool.install import set_fraction

    with pytest.raises(InvalidArgumentError, match="is a cap of 0 bytes, less than the smallest block"):
        Pool(fraction=1e-300)
    with Pool(capacity=1 << 30) as p:
        with pytest.raises(InvalidArgumentError, match="is a cap of 0 bytes"):
            p.set_fraction(1e-300)
        assert p.stats()["limit"] == 1 << 30  # unchanged
        for bad in ("x", -1, True):
            with pytest.raises(ValueError, match="request must be a size in bytes"):
                oom.explain(p, bad)
        p.set_history(16)
        for _ in range(20):
            p.free(p.malloc(MiB))
        assert len(p.history(limit=HISTORY_MAX)) == 16  # (the largest bound the core takes, 2^40 bytes of events)
    for path in (b"/x", "/x\0y"):
        with pytest.raises(InvalidArgumentError, match="lib_path must be a path"):
            Pool(backend="acl", lib_path=path)
    with pytest.raises(InvalidArgumentError, match="device must be a device index"):
        set_fraction(0.5, device=[0])
