"""The streamed snapshot import (npu_pool/trace/pickle_stream.py) against the whole-file read it
replaces: the same traces where both read a file, the same one-line refusal where the whole read
refuses one, and memory bounded by the file."""
from __future__ import annotations

import os
import pickle
import pickletools
import random
import tracemalloc
from pathlib import Path

import pytest

from npu_pool.snapshot import write_parts
from npu_pool.trace import Trace, TraceError
from npu_pool.trace.pickle_stream import NotStreamable
from npu_pool.trace.snapshot import _Bounded, _streamed, _unpickle, check_head, load_snapshot, snapshot_to_traces

M = 1 << 20
_COLUMNS = ("op", "cat", "site", "id", "size", "stream", "addr")


def _whole(path: Path) -> list[Trace]:
    """The reference: the file unpickled whole, then converted (what load_snapshot did before)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        check_head(path, f.read(8))
        f.seek(0)
        obj = _unpickle(_Bounded(f, size), str(path))
    return snapshot_to_traces(obj, str(path), max_elements=size, _consume=True)


def _outcome(read, path: Path) -> tuple:
    """What a read gives: ("ok", traces as plain data) or ("error", message)."""
    try:
        traces = read(path)
    except TraceError as e:
        return "error", str(e)
    return "ok", [(t.meta, *(list(getattr(t, c)) for c in _COLUMNS)) for t in traces]


def _stream_only(path: Path) -> list[Trace]:
    """The streamed read alone: NotStreamable (or TraceError) where load_snapshot would read whole."""
    with open(path, "rb") as f:
        return _streamed(f, path.stat().st_size, str(path))


def _agree(path: Path) -> tuple:
    """load_snapshot agrees with the whole read; the streamed read alone never succeeds where the
    whole read refuses, and never gives another answer."""
    ref = _outcome(_whole, path)
    assert _outcome(load_snapshot, path) == ref
    try:
        alone = _outcome(_stream_only, path)
    except NotStreamable:
        return ref
    if alone[0] == "ok":  # (a TraceError of the streamed read only sends the file to the whole read)
        assert alone == ref, path
    return ref


_FRAMES = [{"filename": "??", "line": 0, "name": "c10::cuda::CUDACachingAllocator::malloc"},
           {"filename": "/home/u/model.py", "line": 12, "name": "forward"},
           {"filename": "/home/u/train.py", "line": 40, "name": "main"}]


def _snapshot(n: int = 40, shared_frames: bool = True) -> dict:
    """A small snapshot in PyTorch's shape: frame dicts (and one frame list) shared between entries."""
    events = []
    for i in range(n):
        frames = _FRAMES if shared_frames else [dict(f) for f in _FRAMES]
        addr = (1 + i % 7) * M
        events.append({"action": "alloc", "addr": addr, "size": 4096 + i, "stream": 0, "time_us": 10 * i,
                       "frames": frames, "compile_context": "", "user_metadata": ""})
        events.append({"action": "free_requested", "addr": addr, "size": 4096 + i, "stream": 0,
                       "time_us": 10 * i + 1, "frames": frames})
        events.append({"action": "free_completed", "addr": addr, "size": 4096 + i, "stream": 0,
                       "time_us": 10 * i + 2, "frames": frames})
    segments = [{"device": 0, "address": M, "total_size": 8 * M, "stream": 0, "segment_type": "large",
                 "is_expandable": False, "frames": [],
                 "blocks": [{"address": M, "size": 8 * M, "requested_size": 0, "state": "inactive", "frames": []}]}]
    return {"segments": segments, "device_traces": [events],
            "allocator_settings": {"expandable_segments": False, "max_split_size": -1},
            "external_annotations": [{"stage": "START", "name": "ProfilerStep#1", "device": 0, "time_us": 5}]}


# -- the same traces --------------------------------------------------------------------------


def test_streamed_import_equals_the_whole_read_on_the_real_snapshots(shared_traces: Path) -> None:
    for path in sorted(shared_traces.glob("*.pickle")):
        ref = _outcome(_whole, path)
        assert ref[0] == "ok", path
        assert _outcome(_stream_only, path) == ref, path.name  # streamed (what load_snapshot returns): no fallback


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_every_pickle_protocol_reads_the_same(tmp_path: Path, protocol: int) -> None:
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(_snapshot(), protocol=protocol))
    assert _agree(path)[0] == "ok"
    if protocol >= 1:  # protocol 0 (text opcodes) is read whole
        assert _outcome(_stream_only, path) == _outcome(_whole, path)


def test_an_export_is_streamed_part_by_part(tmp_path: Path) -> None:
    """npu_pool's own export (write_parts: batches pickled apart, memo indices reused) reads the same."""
    snap = _snapshot(3000, shared_frames=False)
    path = write_parts(tmp_path / "x.pickle", [iter(t) for t in snap.pop("device_traces")], snap)
    assert _outcome(_stream_only, path) == _outcome(_whole, path)
    assert _agree(path)[0] == "ok"


def test_shapes_a_pickler_may_write_read_the_same(tmp_path: Path) -> None:
    """Entries shared between devices and within a list, tuples, one-key dicts, one-item lists,
    nested lists, an empty device, a 1-event device: the streamed read follows or hands over."""
    one = {"action": "alloc", "addr": M, "size": 512, "stream": 0, "frames": []}
    snaps = [
        {"device_traces": [[one] * 50, [one, one]]},
        {"device_traces": [[], [one]], "segments": []},
        {"device_traces": [[one, ("x", 1)]]},
        {"device_traces": [[{"action": "alloc"}]]},
        {"device_traces": [[[1, 2]]]},
        {"device_traces": [[one]], "allocator_settings": {"k": 1}},
        {"device_traces": [[one]], "segments": [{"address": M, "total_size": M, "blocks": [{}]}]},
        {"device_traces": [[one]], "device_traces2": ("a", "b")},
        {"segments": [1], "device_traces": [[one] * 3], "external_annotations": ["x"]},
    ]
    for k, snap in enumerate(snaps):
        for protocol in (2, 4, 5):
            path = tmp_path / f"s{k}.{protocol}.pickle"
            path.write_bytes(pickle.dumps(snap, protocol=protocol))
            _agree(path)


# -- hostile files: the same refusal -------------------------------------------------------------


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_global_inside_device_traces_is_refused_unexecuted(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    snap = _snapshot(5)
    snap["device_traces"][0][3]["frames"] = [_Evil(marker)]
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps(snap))
    with pytest.raises(NotStreamable):
        _stream_only(path)
    with pytest.raises(TraceError, match=r"evil\.pickle: not a PyTorch memory snapshot: the pickle needs the "
                                         r"global posix\.system \(refused, nothing was executed\)"):
        load_snapshot(path)
    assert not marker.exists()


def test_shared_reference_bombs_are_refused_as_before(tmp_path: Path) -> None:
    events = _snapshot(300)["device_traces"][0]
    path = tmp_path / "refs.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [events] * 2000}))  # one list for 2000 devices
    assert _agree(path) == ("error", f"{path}: the snapshot references 1800000 events, segments and blocks in "
                                     f"{path.stat().st_size} bytes: shared references repeated beyond what a real "
                                     "snapshot holds; refused")
    blocks = [{"address": M, "size": M, "requested_size": M, "state": "inactive", "frames": []}] * 1000
    seg = {"device": 0, "address": M, "total_size": M, "blocks": blocks}
    path.write_bytes(pickle.dumps({"device_traces": [events[:3]], "segments": [seg] * 1000}))
    assert "shared references repeated" in _agree(path)[1]
    path.write_bytes(pickle.dumps({"device_traces": [[events[0]] * 50_000]}))  # one entry, 50000 times
    assert _agree(path)[0] == "ok"  # within the bound: read, the entry shared through the memo


def test_truncation_at_every_few_bytes_gives_the_same_message(tmp_path: Path) -> None:
    data = pickle.dumps(_snapshot(8))
    path = tmp_path / "cut.pickle"
    for keep in list(range(0, len(data), 7)) + [len(data) - 1]:
        path.write_bytes(data[:keep])
        kind, message = _agree(path)
        assert kind == "error" and message.startswith(f"{path}: "), keep


def test_flipped_bytes_give_the_same_answer_or_message(tmp_path: Path) -> None:
    """Every byte of a small snapshot replaced by a random one, in protocols 2 and 4. (Not by PUT or
    LONG_BINPUT: a memo index of up to 2^32 makes the C unpickler size its memo to it, seconds and
    gigabytes in either read.)"""
    rng = random.Random(7)
    for protocol in (2, 4):
        data = pickle.dumps(_snapshot(4), protocol=protocol)
        path = tmp_path / f"flip{protocol}.pickle"
        for pos in range(2, len(data)):
            value = rng.choice([v for v in range(256) if v not in b"pr"])
            path.write_bytes(data[:pos] + bytes((value,)) + data[pos + 1:])
            _agree(path)


def test_a_frame_longer_than_its_bytes_is_never_read_as_a_snapshot(tmp_path: Path) -> None:
    """A protocol-4 frame whose stated length runs into the next frame's header (bytes cut out of it, or
    a header changed) is refused by the unpicklers; the scan, which stepped over frames, read such a file
    as a snapshot (a review, a helper: one frame reference cut out of a real snapshot imported)."""
    data = pickle.dumps(_snapshot(3000, shared_frames=False), protocol=4)
    frames = [pos for op, _, pos in pickletools.genops(data) if op.name == "FRAME"]
    assert len(frames) >= 4
    path = tmp_path / "frame.pickle"
    for at in frames[1:4]:
        stated = int.from_bytes(data[at + 1:at + 9], "little")
        for more in (2, 100):
            path.write_bytes(data[:at + 1] + (stated + more).to_bytes(8, "little") + data[at + 9:])
            assert _agree(path)[0] == "error", (at, more)


# -- memory ---------------------------------------------------------------------------------------


def _peak(read, path: Path) -> int:
    tracemalloc.start()
    try:
        read(path)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("shared_frames", [True, False])
def test_the_import_grows_by_less_than_the_file(tmp_path: Path, shared_frames: bool) -> None:
    """Snapshots as PyTorch pickles them (protocol 4) of 4500 and 18000 entries: what the streamed
    import's Python allocations peak at grows by at most 2.5x what the file does and by a third
    of what the whole read's grows by; the traces are the whole read's. (With the frames shared
    an entry takes ~36 bytes of file: less than its 40-byte record beside its row of the trace.)"""
    sizes, streamed, whole = [], [], []
    for n in (1500, 6000):
        path = tmp_path / f"x{n}.pickle"
        path.write_bytes(pickle.dumps(_snapshot(n, shared_frames=shared_frames), protocol=4))
        sizes.append(path.stat().st_size)
        streamed.append(_peak(load_snapshot, path))
        whole.append(_peak(_whole, path))
    assert _outcome(load_snapshot, path) == _outcome(_whole, path)
    grown = sizes[1] - sizes[0]
    assert streamed[1] - streamed[0] < 2.5 * grown, (sizes, streamed, whole)
    assert 3 * (streamed[1] - streamed[0]) < whole[1] - whole[0], (sizes, streamed, whole)


def test_many_devices_without_entries_cost_no_more_than_their_bytes(tmp_path: Path) -> None:
    """A hostile snapshot of 20,000 empty device lists (2 bytes of file each) and one with
    entries: the streamed read makes a device's books only at its first entry (they took 1.5 KB
    a device, 700x the file), so its Python allocations stay near the whole read's (~40x the
    file for either: a Python list and the reader's note of its range for every 2 bytes), and it
    gives the whole read's traces."""
    path = tmp_path / "many.pickle"
    lists = [[] for _ in range(20_000)]
    lists[-1] = _snapshot(3)["device_traces"][0]
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": lists}, protocol=4))
    assert _outcome(load_snapshot, path) == _outcome(_whole, path)
    streamed, whole = _peak(load_snapshot, path), _peak(_whole, path)
    assert streamed < 1.5 * whole and streamed < 60 * path.stat().st_size, (streamed, whole)


# -- memo reads near a cut --------------------------------------------------------------------------


def _s(text: str) -> bytes:
    raw = text.encode()
    return b"\x8c" + bytes((len(raw),)) + raw  # SHORT_BINUNICODE


def _marked_entry(addr: int, frames: list[bytes]) -> bytes:
    """A trace entry made by MARK ... DICT (a hostile writer's way), its frames likewise."""
    return (b"(" + _s("action") + _s("alloc") + _s("addr") + b"J" + addr.to_bytes(4, "little") + _s("size")
            + b"M\x00\x02" + _s("stream") + b"K\x00" + _s("frames") + b"(" + b"".join(frames) + b"ld")


def _frame(filename: bytes, marked: bool = True) -> bytes:
    """A frame dict whose filename is the pickle opcodes ``filename`` (a string, or a memo read)."""
    body = _s("filename") + filename + _s("line") + b"K\x0c" + _s("name") + _s("fwd")
    return b"(" + body + b"d" if marked else b"}(" + body + b"u"


def _listed(entries: list[bytes]) -> bytes:
    """A snapshot of one device's ``entries``, the top dict stored at memo 0 (as a pickler does)."""
    return b"\x80\x04}q\x00(" + _s("device_traces") + b"](](" + b"".join(entries) + b"eeu."


def test_a_text_memo_read_in_an_item_cut_at_its_mark_is_kept_for_it(tmp_path: Path) -> None:
    """A memo read by GET (text) inside an entry made by MARK ... DICT, the entry that ends a range
    at its mark: the read lies in the next range (it was counted in the one before, and the
    string it reads was dropped from the memo before it: another site, silently)."""
    from npu_pool.trace import pickle_stream
    first = b"}(" + _s("action") + _s("alloc") + _s("addr") + b"K\x01" + _s("size") + b"K\x02" + _s("frames") + b"]" \
        + _frame(_s("/home/u/model.py") + b"r\x05\x00\x00\x00", marked=False) + b"au"
    entries, at = [first], len(first)
    while at < pickle_stream._PIECE:  # entries with frames of their own, up to where a range is cut
        entries.append(_marked_entry(4096 * len(entries), [_frame(_s("/home/u/other.py"))]))
        at += len(entries[-1])
    entries.append(_marked_entry(4096 * len(entries), [_frame(b"g5\n")]))  # the only read of memo 5
    entries += [_marked_entry(4096 * (len(entries) + k), [_frame(_s("/home/u/other.py"))]) for k in range(3)]
    path = tmp_path / "get.pickle"
    path.write_bytes(_listed(entries))
    ref = _outcome(_whole, path)
    assert ref[0] == "ok" and ref[1][0][3][len(entries) - 4] == 0  # the site of model.py
    assert _outcome(_stream_only, path) == ref  # streamed, not read whole
    assert _agree(path) == ref


def test_memo_reads_folded_inside_an_item_cut_at_its_mark_are_kept_for_it(tmp_path: Path) -> None:
    """The same with binary reads: an entry made by MARK ... DICT, long enough that the reads met
    inside it are folded (more than _PENDING runs, at a refill) before its DICT ends the range at
    its mark. Its frames' filenames, stored by the entry before, were dropped from the memo."""
    n = 6000  # 45 bytes a frame: the second entry spans a _CHUNK boundary with > _PENDING reads before it
    first = b"}(" + _s("action") + _s("alloc") + _s("addr") + b"K\x01" + _s("size") + b"K\x02" + _s("frames") + b"](" \
        + b"".join(_frame(_s(f"/home/u/f{i}.py") + b"r" + (10 + i).to_bytes(4, "little"), marked=False)
                   for i in range(n)) + b"eu"
    second = _marked_entry(8192, [_frame(b"j" + (10 + i).to_bytes(4, "little")) for i in range(n)])
    path = tmp_path / "gets.pickle"
    path.write_bytes(_listed([first, second]))
    ref = _outcome(_whole, path)
    assert ref[0] == "ok" and ref[1][0][3][:2] == [0, 0]  # both entries at the site of f0.py .. f3.py
    assert _outcome(_stream_only, path) == ref
    assert _agree(path) == ref


@pytest.mark.parametrize("protocol", [1, 2, 3, 4, 5])
def test_an_optimized_pickle_is_streamed(tmp_path: Path, protocol: int) -> None:
    """pickletools.optimize keeps only the memo stores read back: the first store (BINPUT) comes
    among the items, where the scan took it for one mixed with MEMOIZE (and read the file whole)."""
    path = tmp_path / "opt.pickle"
    path.write_bytes(pickletools.optimize(pickle.dumps(_snapshot(50), protocol=protocol)))
    assert _outcome(_stream_only, path) == _outcome(_whole, path)


# -- values no message or site may format whole ----------------------------------------------------


def test_values_python_cannot_or_should_not_format_give_one_line(tmp_path: Path) -> None:
    """An integer of 5000 digits (str() of it raises ValueError), a step number beyond 64 bits
    (OverflowError in the marks' column) or in digits int() refuses ("²"), a list of 2000
    references to one 1 MB string (its repr: 2 GB) and a tuple nested 100,000 deep (repr:
    RecursionError), where a message, a site or the copied allocator_settings show them: the
    whole read's answer (a one-line TraceError or the traces), in time and memory near the file's."""
    big = "x" * M
    nested = b")" + b"\x85" * 100_000  # EMPTY_TUPLE, then TUPLE1 around it 100,000 times

    def entry(**fields) -> dict:
        e = _snapshot(2)
        e["device_traces"][0][0].update(fields)
        return e

    snaps = {
        "int-size": entry(size=10 ** 5000),
        "int-line": entry(frames=[{"filename": "/home/u/a.py", "line": 10 ** 5000, "name": "f"}]),
        "int-setting": dict(_snapshot(2), allocator_settings={"x": 10 ** 5000, 10 ** 5000: 1}),
        "shared-size": entry(size=[big] * 2000),
        "shared-name": entry(frames=[{"filename": "/home/u/a.py", "line": 1, "name": [big] * 2000}]),
        "shared-setting": dict(_snapshot(2), allocator_settings={"x": {"y": [big] * 2000}, "z": {b"k": 1}}),
    }
    for step in ("ProfilerStep#" + "9" * 20, "ProfilerStep#" + "9" * 5000, "step " + "9" * 5000, "layer 99" + "9" * 30,
                 "step ²"):
        snaps[step[:14]] = dict(_snapshot(2), external_annotations=[
            {"stage": "START", "name": step, "device": 0, "time_us": 5}])
    for label, snap in snaps.items():
        path = tmp_path / "v.pickle"
        path.write_bytes(pickle.dumps(snap, protocol=4))
        kind, message = _agree(path)
        assert kind == "ok" or "\n" not in message and len(message) < 400, (label, message)
        assert _peak(lambda p: _outcome(load_snapshot, p), path) < 20 * path.stat().st_size + 4 * M, label
    for fields, field in ((dict(size="SIZE"), b"\x8c\x04SIZE"),  # the size, or a frame's line, nested
                          (dict(frames=[{"filename": "/home/u/a.py", "line": "LINE", "name": "f"}]), b"\x8c\x04LINE")):
        path.write_bytes(pickle.dumps(entry(**fields), protocol=4).replace(field, nested))
        kind, message = _agree(path)
        assert kind == "ok" or "\n" not in message and len(message) < 400, message


def test_a_memo_index_far_beyond_the_stores_is_refused_before_the_unpickler_sizes_its_memo(tmp_path: Path) -> None:
    """LONG_BINPUT 2^26 (or PUT 2^26, also written with 600 leading zeros) in a 1 KB snapshot: the C unpickler sizes its memo to twice
    the index, 8 bytes an entry, zeroed, before anything fails (1 GB in either read; 2^30, 16 GB).
    Refused in one line at once, in the streamed read's place and in the whole read's. (The test
    stays at 2^26: where the refusal is lost, it costs 1 GB, not the machine.)"""
    from npu_pool.trace.pickle_stream import overreach
    data = pickle.dumps(_snapshot(3), protocol=2)
    at = data.index(b"X\x05\x00\x00\x00alloc") + 10  # its BINPUT, in the first entry
    assert data[at] == pickle.BINPUT[0]
    top = data.index(b"}") + 1  # the top dict's BINPUT
    for where, store in ((at, b"r\x00\x00\x00\x04"), (at, b"p67108864\n"), (top, b"r\x00\x00\x00\x04"),
                         (at, b"\x94r\x00\x00\x00\x04"), (at, b"p" + b"0" * 600 + b"67_108_864 \n")):
        path = tmp_path / "memo.pickle"
        path.write_bytes(data[:where] + store + data[where + 2:])
        with open(path, "rb") as f:
            assert f"names index {1 << 26} after" in overreach(f, path.stat().st_size)
        kind, message = _outcome(load_snapshot, path)
        assert kind == "error" and "corrupt or hostile (a memo store at byte" in message and "\n" not in message
        assert _peak(lambda p: _outcome(load_snapshot, p), path) < 4 * M
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):  # what picklers write is never refused
        path.write_bytes(pickle.dumps(_snapshot(40), protocol=protocol))
        with open(path, "rb") as f:
            assert overreach(f, path.stat().st_size) is None


def test_frames_shared_or_long_cost_no_more_than_their_bytes(tmp_path: Path) -> None:
    """One list of 20,000 frames shared by 2000 entries (96 KB: 40 million frames to look at, 1.8 s
    and quadratic in the file) is refused in one line like the other shared-reference bombs; a
    1 MB filename and a 1 MB function name shared by 1000 frames, each its own site (2 MB: 2 GB of
    site strings and 40 s), give sites of bounded length: both reads agree, in time and memory
    near the file's. (Here 256 KB strings.)"""
    frames = [{"filename": "??", "line": 0, "name": "c10::malloc"}] * 20_000
    path = tmp_path / "frames.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [[
        {"action": "alloc", "addr": M * (i + 1), "size": 512, "stream": 0, "frames": frames} for i in range(2000)]]}))
    assert _agree(path) == ("error", f"{path}: the entries and blocks hold more than 16 frames a byte of the file: "
                                     "shared references repeated beyond what a real snapshot holds; refused")
    for filename, name in (("/home/u/" + "a" * (M // 4) + ".py", "f"), ("/home/u/a.py", "n" * (M // 4)),
                           ("/home/u/" + "d/" * 1900 + "a" * 95 + ".py", "f")):
        path.write_bytes(pickle.dumps({"device_traces": [[
            {"action": "alloc", "addr": M * (i + 1), "size": 512, "stream": 0,
             "frames": [{"filename": filename, "line": i, "name": name}]} for i in range(1000)]]}))
        kind, traces = _agree(path)
        assert kind == "ok" and all(len(site) < 400 for site in traces[0][0]["sites"])
        assert _peak(load_snapshot, path) < 4 * path.stat().st_size + 4 * M


def test_a_bytes_object_longer_than_the_file_is_refused_before_it_is_allocated(tmp_path: Path) -> None:
    """BINBYTES8 or BYTEARRAY8 of 2^33 bytes in a 1 KB snapshot: the C unpickler allocates the
    object at its declared length before reading into it (8 GB of address space, untouched:
    tracemalloc counts it). Refused in one line first, in both reads."""
    data = pickle.dumps(_snapshot(3), protocol=4)
    at = data.index(b"\x8c\x05alloc")
    path = tmp_path / "bytes.pickle"
    for op in (b"\x8e", b"\x96"):
        path.write_bytes(data[:at] + op + (1 << 33).to_bytes(8, "little") + data[at + 7:])
        kind, message = _agree(path)
        assert kind == "error" and f"declares {1 << 33} bytes where" in message and "\n" not in message
        assert _peak(lambda p: _outcome(load_snapshot, p), path) < 4 * M


def test_a_file_grown_since_it_was_opened_is_read_to_its_size_only(tmp_path: Path) -> None:
    """The reads are given the size the file had when opened; what was appended since (here, the
    last 20 bytes of a snapshot and more) is not read: the streamed read, like the whole read,
    finds the snapshot truncated (it read on, and gave the traces of bytes past the size)."""
    from npu_pool.trace.pickle_stream import overreach
    for data in (pickletools.optimize(pickle.dumps(_snapshot(3), protocol=2)),
                 b"\x80\x04" + pickle.dumps(_snapshot(3), protocol=4)[11:]):  # (its FRAME left out)
        path = tmp_path / "grown.pickle"
        path.write_bytes(data + b"x" * 100)
        with open(path, "rb") as f:
            with pytest.raises(NotStreamable):
                _streamed(f, len(data) - 20, str(path))
            assert overreach(f, len(data) - 20) is None and f.tell() <= len(data) - 20


@pytest.mark.slow
def test_a_long_text_argument_is_scanned_in_time_linear_in_it(tmp_path: Path) -> None:
    """A protocol-0 UNICODE opcode of 64 MB inside an entry: the scan copied its buffer whole at
    each read of the line (quadratic: 2 s at 32 MB where the whole read takes 0.2 s). Now in
    pieces: the streamed read within twice the whole read's time (best of 2, same run)."""
    import time
    data = pickle.dumps(_snapshot(3), protocol=2)
    at = data.index(b"X\x00\x00\x00\x00")  # the first entry's empty compile_context
    path = tmp_path / "line.pickle"
    path.write_bytes(data[:at] + b"V" + b"a" * (64 * M) + b"\n" + data[at + 5:])

    def best(read) -> float:
        times = []
        for _ in range(2):
            t = time.perf_counter()
            assert _outcome(read, path)[0] == "ok"
            times.append(time.perf_counter() - t)
        return min(times)

    assert best(_stream_only) < 2 * best(_whole) + 0.5


def test_a_million_memo_stores_in_one_entry_cost_no_more_than_the_whole_read(tmp_path: Path) -> None:
    """An entry's value followed by a million MEMOIZEs (1 MB; here a quarter of that, for time):
    the C unpickler's memo takes 16x the file in either read; the streamed read listed the
    indices it drops afterwards as Python ints (90 MB, 5x the whole read's peak). Now dropped a
    piece at a time."""
    data = pickle.dumps(_snapshot(3), protocol=4)
    at = data.index(b"\x8c\x00") + 2  # after the first entry's empty compile_context
    path = tmp_path / "memoize.pickle"
    path.write_bytes(data[:at] + b"\x94" * (M // 4) + data[at:])
    assert _agree(path)[0] == "ok"
    streamed, whole = _peak(load_snapshot, path), _peak(_whole, path)
    assert streamed < 2 * whole, (streamed, whole)


def test_a_large_snapshot_shows_how_far_its_reading_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading a large snapshot took seconds per 50 MB with nothing on the screen (a review, a helper): a
    bar over the bytes both passes read moves forward to the end (shown on a terminal only). Then a
    bar over each device's events as they are translated: that took 14 s after a 1.8 GB snapshot's
    read bar stood at 100% (a review of the commands at scale, a helper)."""
    from npu_pool.progress import ByteProgress
    from npu_pool.trace import snapshot

    path = tmp_path / "s.pickle"
    snap = _snapshot(3000, shared_frames=False)
    path.write_bytes(pickle.dumps(snap, protocol=4))
    size = path.stat().st_size
    bars: list[tuple[str, int | None, list[int]]] = []
    made = ByteProgress.__init__

    def init(self: ByteProgress, desc: str, total: int | None, *args: object, **kwargs: object) -> None:
        made(self, desc, total, *args, **kwargs)
        self.seen = []
        bars.append((desc, total, self.seen))

    monkeypatch.setattr(snapshot, "_BAR_BYTES", 1)
    monkeypatch.setattr(ByteProgress, "__init__", init)
    monkeypatch.setattr(ByteProgress, "to", lambda self, n: self.seen.append(n))
    load_snapshot(path)
    assert [(desc, total) for desc, total, _ in bars] == [("read s.pickle", 2 * size),
                                                          ("convert s.pickle (device 0)", len(snap["device_traces"][0]))]
    for _, total, seen in bars:
        assert len(seen) > 1 and seen == sorted(seen) and seen[-1] == total
    assert len(bars[0][2]) > 3
    monkeypatch.undo()
    bar = ByteProgress("read s.pickle", 2 * size, enabled=True)  # (what a terminal gets)
    bar.to(size)
    bar.to(size // 2)  # (a bar never moves back)
    bar.close()
