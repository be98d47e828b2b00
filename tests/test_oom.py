"""What a failed request leaves behind (npu_pool.oom): one explanation, the core's, per pool; and
the snapshots NPU_POOL_OOM_SNAPSHOT or OOM_SNAPSHOT_ENABLE ask for."""
from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest

from npu_pool import oom
from npu_pool.pool import OutOfMemoryError, Pool

MiB = 1 << 20


@pytest.fixture(autouse=True)
def no_snapshot_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (oom.ENV, oom.ENABLE, oom.PATH):
        monkeypatch.delenv(var, raising=False)


def _fragmented(policy: str = "torch") -> tuple[Pool, list[int]]:
    """A 64 MiB device full of 3 MiB blocks, every other one freed: lots free, nothing contiguous."""
    pool = Pool(policy, capacity=64 * MiB)
    ptrs = []
    with pytest.raises(OutOfMemoryError):
        while True:
            ptrs.append(pool.malloc(3 * MiB))
    for p in ptrs[::2]:
        pool.free(p)
    return pool, ptrs[1::2]


def _fails(pool: Pool, size: int) -> str:
    with pytest.raises(OutOfMemoryError) as e:
        pool.malloc(size)
    return str(e.value)


def test_fragmentation_is_named_in_the_pool_the_request_was_for() -> None:
    pool, _ = _fragmented("torch")
    msg = _fails(pool, 12 * MiB)
    assert "fragmentation: large could serve it" in msg
    x = oom.explain(pool)
    st = pool.stats()
    assert x.kind == "fragmentation" and x.pool == "large" and x.request == 12 * MiB
    assert x.cached_free == st["total"]["reserved"]["current"] - st["total"]["allocated"]["current"]
    assert any("npu_pool" in s for s in x.suggestions) and any("empty_cache" in s for s in x.suggestions)
    assert "Fragmentation" in x.summary()


def test_npu_pools_fragmentation_advice_is_what_can_still_help() -> None:
    """npu_pool's failed request has already returned every wholly free chunk and retried, so an
    empty_cache frees nothing more: its advice is a plan of the iteration, or less held at once
    (before: empty_cache, which did nothing). A fraction cap, when set, is the first lever named:
    the error's notes are cut at 4 KiB, and it is the one that needs no change to the model."""
    pool, _ = _fragmented("npu_pool")
    _fails(pool, 12 * MiB)
    x = oom.explain(pool)
    assert x.kind == "fragmentation" and "npu-pool plan" in x.suggestions[0]
    assert not any("empty_cache" in s for s in x.suggestions)
    reserved = pool.stats()["total"]["reserved"]["current"]
    pool.empty_cache()
    assert pool.stats()["total"]["reserved"]["current"] == reserved  # (what the advice no longer says)
    tip = [s for s in x.suggestions if "npu_pool.compact()" in s]  # (what does help, moving live bytes)
    assert len(tip) == 1 and "NPU_POOL_COMPACT=1" in tip[0] and not pool.stats()["compaction"]
    assert pool.compact() > 0
    pool.malloc(12 * MiB)
    on, _ = _fragmented("npu_pool")
    on.set_compaction(True)
    with pytest.raises(OutOfMemoryError):  # compacted: the live blocks' partial pages are what is left free
        on.malloc(30 * MiB)
    x = oom.explain(on)
    assert x.kind == "fragmentation" and on.stats()["compaction"] and not any("compact" in s for s in x.suggestions)
    capped = Pool("torch", capacity=64 * MiB, fraction=0.5)
    _fails(capped, 40 * MiB)
    assert oom.explain(capped).suggestions[0].startswith("raise the memory fraction cap (50% of the device)")


def test_a_shortage_and_a_request_larger_than_the_cap_are_told_apart() -> None:
    pool, _ = _fragmented("npu_pool")
    msg = _fails(pool, 40 * MiB)  # more than everything free, in any arrangement
    assert "a real shortage" in msg
    x = oom.explain(pool)
    assert x.kind == "shortage" and any("recompute" in s for s in x.suggestions)
    assert any("ZeRO" in s for s in x.suggestions) and any("offload" in s for s in x.suggestions)
    tiny = Pool("npu_pool", capacity=1)  # a 1-byte cap: even 1 byte needs a whole 2 MiB page
    msg = _fails(tiny, 1)
    assert "needs 2.00 MiB in one piece, more than the whole cap" in msg and "live tensors" not in msg
    assert oom.explain(tiny).kind == "too_large"
    capped = Pool("npu_pool", capacity=64 * MiB, fraction=0.5)
    _fails(capped, 40 * MiB)
    assert any("fraction" in s for s in oom.explain(capped).suggestions)


def test_the_history_keeps_the_failure_with_its_reason() -> None:
    pool, _ = _fragmented("torch")
    _fails(pool, 12 * MiB)
    (ev,) = [e for e in pool.history() if e["kind"] == "oom"][-1:]
    assert ev["size"] == 12 * MiB and ev["detail"] == 2 and pool.stats()["pools"] and ev["pool"] == 1


def test_the_json_names_the_cores_tags_of_free_memory(tmp_path: Path) -> None:
    """An event's stream in the .json is a number a JSON reader keeps, or the name of the core's tag
    of free memory (a plan's region is reserved for no one stream; memory freed after two streams
    used it is "mixed"): the tag's 64-bit integer was written, which JavaScript's numbers round."""
    pool = Pool("planned", capacity=1024 * MiB)
    pool.set_plan([100 * MiB, 100 * MiB], [0, 500 * MiB], [2, 2], 0, 600 * MiB, 2)
    a = pool.malloc(100 * MiB, stream=7)
    pool.malloc(100 * MiB, stream=7)
    pool.record_stream(a, 9)
    pool.free(a)  # its memory, used on two streams, is tagged "mixed" (a free block of no one stream)
    _fails(pool, 950 * MiB)
    doc = json.loads(oom.write_snapshot(pool, tmp_path).with_suffix(".json").read_text())
    assert doc["format"] == "npu_pool.oom/6"
    streams = {e["kind"]: e["stream"] for e in doc["history"]}
    assert streams["segment_alloc"] == "any" and streams["alloc"] == 7  # (the region is no one stream's)
    assert "mixed" in {b["stream"] for b in doc["blocks"]}
    assert all(isinstance(x, str) or abs(x) < 1 << 53 for x in [b["stream"] for b in doc["blocks"]] + list(streams.values()))


def test_write_snapshot(tmp_path: Path) -> None:
    pool, live = _fragmented()
    _fails(pool, 12 * MiB)
    path = oom.write_snapshot(pool, tmp_path / "snaps")
    doc = json.loads(path.with_suffix(".json").read_text())
    assert doc["explanation"]["request"] == 12 * MiB and doc["explanation"]["kind"] == "fragmentation"
    assert sum(b["allocated"] for b in doc["blocks"]) == len(live)
    assert doc["history"][-1]["kind"] == "oom"
    snap = pickle.loads(path.read_bytes())
    from torch.cuda import _memory_viz

    text = _memory_viz.segsum(snap)
    assert f"total_reserved: {_memory_viz._format_size(pool.stats()['total']['reserved']['current'])}" in text
    assert snap["device_traces"][0][-1]["action"] == "oom" and snap["device_traces"][0][-1]["size"] == 12 * MiB


def test_snapshot_names_skip_one_another_process_took(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks in containers (their own pid namespaces, often pid 1) writing to one folder could take
    one name in the same second and silently replace each other's snapshot (a review): the name
    carries the host and the device, and a name already taken is skipped."""
    import itertools
    import socket
    import time

    pool, _ = _fragmented()
    _fails(pool, 12 * MiB)
    monkeypatch.setattr(time, "strftime", lambda fmt, *a: "20261127-000000")
    monkeypatch.setattr(oom, "_numbers", itertools.count())
    monkeypatch.setattr(os, "getpid", lambda: 1)
    monkeypatch.setattr(socket, "gethostname", lambda: "node/7")
    taken = tmp_path / "oom_snapshot_node-7_1_dev3_20261127-000000_0000.pickle"
    taken.write_bytes(b"another rank's")
    path = oom.write_snapshot(pool, tmp_path, device=3)
    assert path.name == "oom_snapshot_node-7_1_dev3_20261127-000000_0001.pickle"
    assert taken.read_bytes() == b"another rank's" and path.with_suffix(".json").is_file()


@pytest.mark.parametrize("rules", ["npu", "cuda"])
def test_a_snapshot_says_whose_request_rules_it_was_made_under(tmp_path: Path, rules: str) -> None:
    """An OOM snapshot of a pool under torch_npu's rules is read back as an NPU trace, so that
    analyze replays it with torch_npu's padding (before: every snapshot of npu_pool's own read
    as CUDA's, and analyze said a policy would have served a request the live pool could not)."""
    from npu_pool.trace.snapshot import load_snapshot

    pool = Pool("npu_pool", capacity=64 * MiB, rules=rules)
    assert pool.device_rules == rules
    _fails(pool, 100 * MiB)
    path = oom.write_snapshot(pool, tmp_path)
    assert pickle.loads(path.read_bytes())["allocator_settings"]["device_type"] == rules
    assert load_snapshot(path)[0].meta["device_type"] == rules


def test_on_oom_writes_only_when_asked_and_never_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool, _ = _fragmented()
    _fails(pool, 12 * MiB)
    assert oom.on_oom(pool, 12 * MiB) is None
    monkeypatch.setenv(oom.ENV, str(tmp_path / "d"))
    msg = oom.on_oom(pool, 12 * MiB)
    (written,) = (tmp_path / "d").glob("*.pickle")
    assert str(written) in msg and "Fragmentation" in msg
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    for bad in (blocker, blocker / "sub"):
        monkeypatch.setenv(oom.ENV, str(bad))
        msg = oom.on_oom(pool, 12 * MiB)
        assert "cannot write" in msg and str(bad) in msg and "Fragmentation" in msg


def test_a_failed_snapshot_takes_no_slot_and_a_half_written_one_is_named(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Snapshots that could not be written do not count toward the bound of MAX_SNAPSHOTS per
    process (before: a full disk used the bound up, and later failures said '20 already written'
    with none there); a pickle written without its .json is named as written."""
    pool, _ = _fragmented()
    _fails(pool, 12 * MiB)
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    monkeypatch.setattr(oom, "_written", 0)
    monkeypatch.setenv(oom.ENV, str(blocker))
    for _ in range(oom.MAX_SNAPSHOTS + 2):
        assert "cannot write" in oom.on_oom(pool, 12 * MiB)
    monkeypatch.setenv(oom.ENV, str(tmp_path / "d"))
    assert "written to" in oom.on_oom(pool, 12 * MiB) and oom._written == 1
    from npu_pool import outputs

    def no_room(path: object, text: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(outputs, "write_text", no_room)
    msg = oom.on_oom(pool, 12 * MiB)
    pickles = sorted((tmp_path / "d").glob("*.pickle"))
    assert len(pickles) == 2 and f"written to {pickles[-1]}, but not its .json explanation: No space left" in msg
    assert oom._written == 2
    assert pickles[0].name < pickles[1].name  # names sort in the order they were written


def test_torch_npus_switch_asks_for_snapshots_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert oom.snapshot_dir({}) is None
    assert oom.snapshot_dir({oom.ENABLE: "1"}) == "."
    assert oom.snapshot_dir({oom.ENABLE: "1", oom.PATH: str(tmp_path)}) == str(tmp_path)
    assert oom.snapshot_dir({oom.ENABLE: "0", oom.PATH: str(tmp_path)}) is None
    # torch_npu's 2 (its snapshot without the history) asks for one too: under npu_pool none was written
    assert oom.snapshot_dir({oom.ENABLE: "2", oom.PATH: str(tmp_path)}) == str(tmp_path)
    assert oom.snapshot_dir({oom.ENV: "x", oom.ENABLE: "1", oom.PATH: "y"}) == "x"


def test_pool_malloc_oom_names_the_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool, _ = _fragmented()
    monkeypatch.setenv(oom.ENV, str(tmp_path / "oom"))
    msg = _fails(pool, 12 * MiB)
    (path,) = (tmp_path / "oom").glob("*.pickle")
    assert str(path) in msg and "Fragmentation" in msg and msg.count("out of memory on device") == 1
    file_path = tmp_path / "plain"
    file_path.write_text("")
    monkeypatch.setenv(oom.ENV, str(file_path))
    assert "cannot write" in _fails(pool, 12 * MiB)  # a bad setting still raises the OOM, with a clear note
    monkeypatch.delenv(oom.ENV)
    assert "OOM snapshot" not in _fails(pool, 12 * MiB)
    assert sorted(os.listdir(tmp_path / "oom")) == sorted([path.name, path.with_suffix(".json").name])


def test_a_forked_child_writes_its_own_snapshots(tmp_path: Path) -> None:
    """The bound of MAX_SNAPSHOTS is per process: a child forked after its parent wrote them all
    wrote none ('20 already written by this process', the threads-and-fork review)."""
    import subprocess
    import sys

    code = f"""
import os, npu_pool
from npu_pool import oom
os.environ[oom.ENV] = {str(tmp_path)!r}
p = npu_pool.Pool("npu_pool", capacity=64 << 20)
for _ in range(oom.MAX_SNAPSHOTS + 1):
    try:
        p.malloc(1 << 30)
    except npu_pool.OutOfMemoryError as e:
        last = str(e)
assert "already written" in last, last
pid = os.fork()
if pid == 0:
    try:
        npu_pool.Pool("npu_pool", capacity=64 << 20).malloc(1 << 30)
    except npu_pool.OutOfMemoryError as e:
        os._exit(0 if "[OOM snapshot] written to" in str(e) else 3)
    os._exit(4)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), pid)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    status, child = r.stdout.split()
    assert status == "0"
    written = sorted(f.name for f in tmp_path.glob("*.pickle"))
    assert len(written) == oom.MAX_SNAPSHOTS + 1 and sum(f"_{child}_" in n for n in written) == 1


def test_a_request_past_the_arena_names_itself_not_a_full_range() -> None:
    """3 GiB on an empty 1 GiB device said '[the arena's address range is full]' (a review of the
    torch_npu path): the request alone passes the range."""
    with Pool(capacity=1 << 30) as p:
        with pytest.raises(OutOfMemoryError) as e:
            p.malloc(3 << 30)
        assert "more than the whole cap [the request is larger than the arena's whole address range (2.00 GiB)]" \
            in str(e.value) and "is full" not in str(e.value)


def test_a_largest_free_block_with_pages_not_mapped_yet_says_so() -> None:
    """The npu_pool arena's largest free block counts the pages the cap still lets it map, so an
    out-of-memory message said "largest free block 10.00 MiB" where the pool held 2.92 MiB free
    in all (a review of the reports, 2.92 MiB: reserved less allocated); the message and the explanation now say what it counts."""
    import random

    rnd = random.Random(1)
    live = []
    with Pool("npu_pool", capacity=256 << 20) as pool:
        with pytest.raises(OutOfMemoryError) as e:
            for _ in range(100_000):
                live.append(pool.malloc(rnd.choice([1 << 20, 3 << 20, 7 << 20, 512, 100 << 10, 13 << 20]),
                                        lifetime=rnd.choice(["auto", "long", "short"])))
                if rnd.random() < 0.45:
                    pool.free(live.pop(rnd.randrange(len(live))))
        st = pool.stats()
        assert st["largest_free"] > st["total"]["reserved"]["current"] - st["total"]["allocated"]["current"]
        assert "(with pages the cap still allows mapping: more than the pool holds free)" in str(e.value)
        assert "(with pages the cap still allows mapping)" in oom.explain(pool).summary()
        for p in live:
            pool.free(p)
    # paused bytes are allocated, not reserved: with a paused region the remark compared the
    # largest free block with reserved less allocated and fired where the cap left nothing to map
    # (a review of the diff)
    with Pool("npu_pool", capacity=256 << 20) as pool:
        with pool.region("a"):
            t = pool.malloc(64 << 20)
        pool.pause("a")
        xs = []
        with pytest.raises(OutOfMemoryError):
            while True:
                xs.append(pool.malloc(8 << 20))
        pool.free(xs.pop(5))
        pool.free(xs.pop(5))  # 16 MiB mapped and free, in one piece
        with pytest.raises(OutOfMemoryError) as e:
            pool.malloc(100 << 20)
        st = pool.stats()
        assert st["paused"] == 64 << 20 and st["largest_free"] == 16 << 20
        assert "with pages the cap still allows" not in str(e.value)
        x = oom.explain(pool)
        assert x.cached_free == 16 << 20 and "with pages the cap still allows" not in x.summary()
        for p in xs:
            pool.free(p)
        pool.resume("a")
        pool.free(t)

