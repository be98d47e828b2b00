"""Tagged regions: pause and resume (docs/colocated.md) on the simulated device, over the fake
vendor runtimes (plain Pool and the pluggable-allocator entry points), and in replays."""
from __future__ import annotations

import ctypes
import importlib
import json
import os
import subprocess

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import npu_pool
from npu_pool import Pool
from npu_pool._core import ffi, lib as so
from npu_pool.pool import BACKENDS, POLICIES, InvalidArgumentError, OutOfMemoryError, PoolError
from npu_pool.trace.format import OP_ALLOC, OP_FREE, OP_PAUSE, OP_REGION, OP_RESUME, Trace, TraceError
from npu_pool import oom, replay

from test_backends import FAKES, MiB, Vendor, _compiler, _vendor, builds  # noqa: F401  (fixture)
from conftest import unavailable

inst = importlib.import_module("npu_pool.install")
PAGE = 2 * MiB


def _fill(addr: int, size: int, byte: int) -> None:
    ctypes.memset(addr, byte, size)


def _holds(addr: int, size: int, byte: int) -> bool:
    return ctypes.string_at(addr, size) == bytes([byte]) * size


def _books_match(p: Pool) -> None:
    """The core's invariants hold, and reserved bytes are exactly the mapped ranges."""
    p.check()
    assert p.stats()["total"]["reserved"]["current"] == sum(n for _, n in p.mapped_ranges())


# ---- the simulated device -------------------------------------------------------------------------

def test_pause_returns_the_tag_keeps_addresses_and_resume_restores_contents() -> None:
    with Pool(capacity=256 * MiB, host_backed=True) as p:
        with p.region("train"):
            w = [p.malloc(n) for n in (40 * MiB, 3 * MiB + 5, 1000)]
        other = p.malloc(8 * MiB)  # outside the region: stays mapped
        for i, (a, n) in enumerate(zip(w, (40 * MiB, 3 * MiB + 5, 1000))):
            _fill(a, n, i + 1)
        _fill(other, 8 * MiB, 9)
        assert {r for r in p.tags()} == {"train"}
        reserved = p.stats()["total"]["reserved"]["current"]
        given_back = p.pause("train", backup=True)
        st_ = p.stats()
        assert given_back >= 40 * MiB + 3 * MiB and st_["total"]["reserved"]["current"] == reserved - given_back
        assert st_["paused"] == p.tags()["train"]["paused"] > 0
        assert st_["backup"] == 40 * MiB + 3 * MiB + 5 + 1000
        assert _holds(other, 8 * MiB, 9)
        _books_match(p)
        # the freed device memory serves others
        big = p.malloc(given_back)
        _fill(big, given_back, 7)
        p.free(big)
        mapped = p.resume("train")
        assert mapped == st_["paused"]
        for i, (a, n) in enumerate(zip(w, (40 * MiB, 3 * MiB + 5, 1000))):
            assert _holds(a, n, i + 1), f"block {i} lost its contents"
        assert p.stats()["paused"] == 0 and p.stats()["backup"] == 0
        _books_match(p)
        assert p.block_size(w[0]) >= 40 * MiB  # same blocks, same addresses


def test_errors_are_errors_not_corruption() -> None:
    with Pool(capacity=64 * MiB, host_backed=True) as p:
        with pytest.raises(InvalidArgumentError, match="no tag 'x'"):
            p.pause("x")
        with pytest.raises(InvalidArgumentError, match="no tag 'x'"):
            p.resume("x")
        with p.region("rollout"):
            a = p.malloc(4 * MiB)
        with pytest.raises(PoolError, match="not paused"):
            p.resume("rollout")
        p.pause("rollout")
        with pytest.raises(PoolError, match="already paused"):
            p.pause("rollout")
        with p.region("rollout"):
            with pytest.raises(PoolError, match="paused; resume it first"):
                p.malloc(1)
        p.free(a)  # allowed: its pages stay released
        assert p.tags()["rollout"]["paused"] == 0 and p.tags()["rollout"]["blocks"] == 0
        _books_match(p)
        assert p.resume("rollout") == 0
        for bad, why in (("", "a tag is a non-empty string"), (3, "a tag is a non-empty string"),
                         ("é", "is not ASCII"), ("a\0b", "holds a NUL character"), ("a\x01", "printable ASCII"),
                         ("x" * 64, "at most 63 bytes")):
            with pytest.raises(InvalidArgumentError, match=why):
                p.pause(bad)  # type: ignore[arg-type]
        _books_match(p)
    with Pool("torch", capacity=64 * MiB) as p, pytest.raises(PoolError, match="need policy npu_pool"):
        with p.region("t"):
            pass
    with Pool(capacity=64 * MiB, vmm=False) as p, pytest.raises(PoolError, match="virtual-memory API"):
        with p.region("t"):
            pass


def test_regions_nest_and_tags_get_their_own_address_range() -> None:
    with Pool(capacity=64 * MiB) as p:
        with p.region("a"):
            x = p.malloc(1 * MiB)
            with p.region("b"):
                y = p.malloc(1 * MiB)
            x2 = p.malloc(1 * MiB)
        z = p.malloc(1 * MiB)
        t = p.tags()
        assert t["a"]["blocks"] == 2 and t["b"]["blocks"] == 1 and not t["a"]["current"]
        segs = {b["addr"]: b["segment"] for b in p.blocks() if b["allocated"]}
        assert len({segs[x], segs[y], segs[z]}) == 3 and segs[x] == segs[x2]
        _books_match(p)


def test_a_region_left_under_a_later_one_leaves_the_later_one_current() -> None:
    """Regions are the pool's: thread 1 enters A, thread 2 enters B, thread 1 leaves A. B stays
    current (before: leaving popped B, the top, and B's requests went to A, which pausing A then
    unmapped). Each thread here is one context manager, driven in that interleaving."""
    with Pool(capacity=64 * MiB) as p:
        a, b = p.region("A"), p.region("B")
        a.__enter__()
        b.__enter__()
        a.__exit__(None, None, None)
        p.malloc(MiB)
        t = p.tags()
        assert (t["A"]["blocks"], t["B"]["blocks"]) == (0, 1) and t["B"]["current"]
        b.__exit__(None, None, None)
        p.malloc(MiB)  # no region open: the main arena
        assert p.tags()["B"]["blocks"] == 1 and not any(x["current"] for x in p.tags().values())
        _books_match(p)


def test_another_thread_entering_another_tag_is_warned_about() -> None:
    """A region is the pool's (backward threads allocate into it): a second thread entering
    another tag while the first's region is open sends the first thread's requests to it too,
    and pausing it would take them (the threads review: 8 MiB of 'train' allocated as 'rollout').
    Safe while the first thread waits (an offload hook on the autograd thread), so it is allowed,
    with one warning per pool; the same tag, and threads that enter no region, say nothing."""
    import threading
    import warnings

    with Pool(capacity=256 * MiB) as p:
        entered, done, got = threading.Event(), threading.Event(), {}

        def trainer() -> None:
            with p.region("train"):
                entered.set()
                assert done.wait(120)
                got["train"] = p.malloc(8 * MiB)

        def other(tag: str) -> None:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with p.region(tag):
                    got[tag] = p.malloc(MiB)
            got[tag + " warned"] = [str(w.message) for w in caught]

        t = threading.Thread(target=trainer)
        t.start()
        assert entered.wait(120)
        for tag in ("train", "rollout", "offload"):
            u = threading.Thread(target=other, args=(tag,))
            u.start()
            u.join()
        backward = threading.Thread(target=lambda: got.__setitem__("backward", p.malloc(2 * MiB)))
        backward.start()
        backward.join()
        done.set()
        t.join()
        assert got["train warned"] == [] and got["offload warned"] == []  # (once per pool)
        (message,) = got["rollout warned"]
        assert "region 'rollout' entered while another thread holds region 'train'" in message
        tags = p.tags()
        assert tags["rollout"]["allocated"] == tags["offload"]["allocated"] == MiB
        assert tags["train"]["allocated"] == 11 * MiB  # 8 + 1 (same tag) + 2 (no region: the current one)
        _books_match(p)


def _fork_beside_another_threads_region(p: Pool, mine: bool) -> int:
    """Another thread holds region 'other' open (entered last, so current) while this one, inside
    region 'mine' or in none, forks. The child's exit status: 0 where its untagged request went
    to 'mine' (inside it) or to no region, and 'other' is not current."""
    import threading

    entered, release = threading.Event(), threading.Event()

    def holder() -> None:
        with p.region("other"):
            entered.set()
            release.wait(120)

    t = threading.Thread(target=holder)
    t.start()
    try:
        assert entered.wait(120)
        pid = os.fork()
        if pid == 0:  # the child: only this thread
            import signal

            signal.alarm(60)  # (a hook that hung would fail the test, not hang the suite)
            try:
                before = p.tags()
                p.malloc(MiB)
                after = p.tags()
                ok = not after["other"]["current"] and after["other"]["blocks"] == before["other"]["blocks"]
                if mine:
                    ok = ok and after["mine"]["current"] and after["mine"]["blocks"] == before["mine"]["blocks"] + 1
                os._exit(0 if ok else 1)
            except BaseException:  # noqa: BLE001 - the exit status says it
                os._exit(2)
        return os.waitpid(pid, 0)[1]
    finally:
        release.set()
        t.join()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork: POSIX only")
def test_a_forked_child_leaves_the_regions_other_threads_held_open() -> None:
    """A child has only the thread that forked: a region another thread held open stayed the
    pool's for ever there (every untagged request went to it, and pausing it failed them all; the
    threads review). The child leaves those; a region of the forking thread stays current."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (two threads' regions: the warning has its own test)
        with Pool(capacity=256 * MiB) as p:
            assert _fork_beside_another_threads_region(p, mine=False) == 0
            with p.region("mine"):
                assert _fork_beside_another_threads_region(p, mine=True) == 0
                assert p.tags()["mine"]["current"]  # the parent's: as they were (the holder's left)
            assert not any(x["current"] for x in p.tags().values())
            _books_match(p)


def test_a_pool_closed_inside_a_region_leaves_the_bodys_exception() -> None:
    """close() from another thread while a region is open: leaving the region raised 'closed
    pool' over the body's own exception."""
    p = Pool(capacity=64 * MiB)
    with pytest.raises(KeyError, match="the body's own"):
        with p.region("train"):
            p.close()
            raise KeyError("the body's own error")


def test_resume_gives_back_idle_memory_first_and_fails_whole_when_short() -> None:
    with Pool(capacity=64 * MiB, host_backed=True) as p:
        with p.region("train"):
            w = p.malloc(30 * MiB)
        _fill(w, 30 * MiB, 5)
        p.pause("train", backup=True)
        kv = p.malloc(50 * MiB)
        p.free(kv)  # idle in the main arena: must not block the resume
        assert p.stats()["total"]["reserved"]["current"] >= 50 * MiB
        p.resume("train")
        assert _holds(w, 30 * MiB, 5)
        _books_match(p)
        # now a live rollout tensor leaves no room: a clear OOM naming the tag, nothing half-mapped
        p.pause("train", backup=True)
        kv = p.malloc(50 * MiB)
        reserved = p.stats()["total"]["reserved"]["current"]
        with pytest.raises(OutOfMemoryError, match="resume of tag 'train'"):
            p.resume("train")
        assert p.stats()["total"]["reserved"]["current"] == reserved and p.tags()["train"]["is_paused"]
        x = oom.explain(p)  # the failed resume is the failure explained, not an earlier one
        assert (x.kind, x.request) == ("shortage", p.tags()["train"]["paused"]) and x.room == 64 * MiB - reserved
        _books_match(p)
        p.free(kv)
        p.resume("train")
        assert _holds(w, 30 * MiB, 5)
        _books_match(p)


def test_backup_is_bounded() -> None:
    with Pool(capacity=64 * MiB, host_backed=True) as p:
        with p.region("train"):
            p.malloc(10 * MiB)
        p.set_backup_limit(8 * MiB)
        reserved = p.stats()["total"]["reserved"]["current"]
        with pytest.raises(OutOfMemoryError, match="backup bound.*set_backup_limit raises the bound"):
            p.pause("train", backup=True)
        assert not p.tags()["train"]["is_paused"] and p.stats()["total"]["reserved"]["current"] == reserved
        p.pause("train")  # without backup: fine
        _books_match(p)
        p.resume("train")
        # the bound lowered while a tag is paused with its backup: at resume its buffer goes back,
        # and the next pause with backup is held to the bound again
        p.set_backup_limit(64 * MiB)
        p.pause("train", backup=True)
        p.set_backup_limit(0)
        assert p.stats()["backup_held"] >= 10 * MiB  # (it holds the backup: it stays until resume)
        p.resume("train")
        assert p.stats()["backup_held"] == 0
        with pytest.raises(OutOfMemoryError, match="backup bound"):
            p.pause("train", backup=True)
        _books_match(p)
    with Pool(capacity=64 * MiB, host_backed=True) as p:  # many small tensors: the bound counts their bytes
        with p.region("small"):  # rounded up to 64 each, not to a block's 512
            for _ in range(1000):
                p.malloc(4)
        p.set_backup_limit(65536)
        p.pause("small", backup=True)
        assert p.stats()["backup"] == 4000 and p.stats()["backup_held"] == 64000
        p.resume("small")
        _books_match(p)


def test_module_api_needs_an_installed_pool_or_a_pool() -> None:
    inst._reset()
    with pytest.raises(PoolError, match="no npu_pool allocator is installed"):
        npu_pool.pause("train")
    with Pool(capacity=64 * MiB) as p:
        with npu_pool.region("train", pool=p):
            p.malloc(MiB)
        mapped = p.tags()["train"]["mapped"]  # the chunk the tag's arena grew by: at least the block's page
        assert mapped >= PAGE
        assert npu_pool.pause("train", pool=p) == mapped  # pausing returns the whole chunk
        assert p.tags()["train"]["paused"] == PAGE  # what resume maps again: the page under the block
        assert npu_pool.resume("train", pool=p) == PAGE
        assert p.tags()["train"]["mapped"] == PAGE


def test_an_installed_pool_whose_device_torch_cannot_name_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a multiprocessing child forked from a torch_npu process, torch_npu refuses
    current_device(): pause/resume/tags said no allocator was installed, which it is (a review of
    pause/resume inside torch_npu, 2026-11-27)."""
    from npu_pool import colocate

    with Pool(capacity=64 * MiB) as p:
        monkeypatch.setattr(colocate, "current_pool", lambda: None)
        monkeypatch.setattr(colocate, "installed", lambda: {0: p})
        with pytest.raises(PoolError, match="npu_pool is installed, but torch cannot say which device is current"):
            npu_pool.tags()


# ---- property test: random pause/resume/alloc/free keep the books equal to the device -------------

ops = st.lists(st.tuples(st.sampled_from(["alloc", "free", "pause", "backup", "resume", "region", "empty"]),
                         st.integers(0, 2), st.integers(1, 6 * MiB)), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seq=ops)
# (random sequences rarely back up a tag's tensors and resume it: these two always do)
@example(seq=[("region", 0, 1), ("alloc", 0, 3 * MiB), ("region", 2, 1), ("backup", 0, 1), ("alloc", 2, 5 * MiB),
              ("resume", 0, 1), ("region", 1, 1), ("alloc", 1, 2 * MiB), ("backup", 1, 1)])
@example(seq=[("region", 1, 1), ("alloc", 1, 1 * MiB), ("pause", 1, 1), ("resume", 1, 1), ("alloc", 1, 2 * MiB),
              ("backup", 1, 1), ("empty", 0, 1)])
def test_random_pause_resume_sequences_keep_the_books(seq: list) -> None:
    tags = ["t0", "t1", None]
    with Pool(capacity=48 * MiB, host_backed=True) as p:
        live: dict[int, list] = {}  # addr -> [size, byte, tag, contents kept: no pause without backup since]
        paused: set[str] = set()
        byte = 0
        for op, k, size in seq:
            tag = tags[k]
            try:
                if op == "region":
                    so.np_region(p.ctx, tag.encode() if tag else ffi.NULL)
                    current = tag
                elif op == "alloc":
                    current = next((t for t in p.tags() if p.tags()[t]["current"]), None)
                    a = p.malloc(size)
                    byte = byte % 250 + 1
                    _fill(a, size, byte)
                    live[a] = [size, byte, current, True]
                elif op == "free" and live:
                    a = sorted(live)[size % len(live)]
                    p.free(a)
                    del live[a]
                elif op in ("pause", "backup") and tag:
                    was = p.tags().get(tag, {}).get("is_paused", False)
                    try:
                        p.pause(tag, backup=op == "backup")
                    finally:  # (a pause that fails pauses nothing)
                        if op == "pause" and not was and p.tags().get(tag, {}).get("is_paused", False):
                            for rec in live.values():
                                rec[3] = rec[3] and rec[2] != tag  # pages released: contents gone
                    paused.add(tag)
                elif op == "resume" and tag:
                    p.resume(tag)
                    paused.discard(tag)
                elif op == "empty":
                    p.empty_cache()
            except (PoolError, OutOfMemoryError):
                pass
            paused = {t for t, d in p.tags().items() if d["is_paused"]}
            _books_match(p)
            assert p.stats()["paused"] == sum(d["paused"] for d in p.tags().values())
        # every tensor of a tag that is not paused kept its contents... once its tag is resumed
        for t in list(paused):
            try:
                p.resume(t)
            except OutOfMemoryError:
                continue
        resumed = {t for t, d in p.tags().items() if not d["is_paused"]}
        for a, (size, b, tag, kept) in live.items():
            # untagged tensors and those of a resumed tag whose every pause kept a backup hold what
            # was written (tensors paused without backup lose their contents: pages were released)
            if tag is None or (tag in resumed and kept):
                assert _holds(a, size, b), (tag, size)
        _books_match(p)


# ---- the fake vendor runtimes ---------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["acl", "cuda"])
def test_vendor_device_memory_goes_back_and_comes_back(builds: dict, backend: str) -> None:  # noqa: F811
    v = _vendor(builds, backend, capacity=128 * MiB)
    with v.pool() as p:
        with p.region("train"):
            w = p.malloc(60 * MiB - v.pad)
        _fill(w, 60 * MiB - v.pad, 3)
        # the device could not hold both
        with pytest.raises(OutOfMemoryError):
            p.malloc(70 * MiB)
        used = v.lib.fake_used()  # (pages the failed request mapped stay, counted, until reused or released)
        if backend == "acl":  # the plain fake ACL has no aclrtMemcpy: backups are refused clearly
            with pytest.raises(PoolError, match="cannot copy device memory"):
                p.pause("train", backup=True)
            assert v.lib.fake_used() == used
        back = p.pause("train", backup=backend == "cuda")
        assert v.lib.fake_used() == used - back and back >= 60 * MiB
        kv = p.malloc(70 * MiB)
        p.free(kv)
        assert p.resume("train") == back
        assert v.lib.fake_used() <= 128 * MiB and p.stats()["total"]["reserved"]["current"] == v.lib.fake_mapped()
        if backend == "cuda":
            assert _holds(w, 60 * MiB - v.pad, 3)
        p.check()
        # another process takes the memory the pause gave back: the resume fails, naming the device
        p.pause("train", backup=backend == "cuda")
        v.lib.fake_set_used(128 * MiB - v.lib.fake_used())
        with pytest.raises(OutOfMemoryError, match="resume of tag 'train'.*the device refused memory the cap allows"):
            p.resume("train")
        x = oom.explain(p)
        assert (x.kind, x.request, x.room) == ("device", p.tags()["train"]["paused"], 0)
        p.check()
        v.lib.fake_set_used(0)
        p.resume("train")
        if backend == "cuda":
            assert _holds(w, 60 * MiB - v.pad, 3)
        p.check()


def test_a_tags_pinned_buffer_serves_every_pause_until_close(builds: dict) -> None:  # noqa: F811
    """Colocated RL pauses the same tensors every iteration: one pinned host allocation serves
    them all (pinning and unpinning cost far more than the copies on an H100: docs/gpu.md)."""
    v = _vendor(builds, "cuda", capacity=128 * MiB)
    pinned = lambda: (v.lib.fake_calls(b"cudaMallocHost"), v.lib.fake_calls(b"cudaFreeHost"))  # noqa: E731
    sizes = [3 * MiB + 100, 5 * MiB, 700, 64 * 1024] + [4096 * k + 3 for k in range(1, 9)]
    with v.pool() as p:
        with p.region("train"):
            blocks = [p.malloc(n) for n in sizes]
        with p.region("kv"):
            kv = p.malloc(4 * MiB)
        for i, (a, n) in enumerate(zip(blocks, sizes)):
            _fill(a, n, 10 + i)
        looked_up = 0
        for _ in range(3):
            before = v.lib.fake_calls(b"cudaGetDevice")
            p.pause("train", backup=True)
            st = p.stats()
            assert st["backup"] == sum(sizes) and st["backup_held"] >= sum(sizes)
            p.resume("train")
            looked_up += v.lib.fake_calls(b"cudaGetDevice") - before
            assert all(_holds(a, n, 10 + i) for i, (a, n) in enumerate(zip(blocks, sizes)))
            assert p.stats()["backup"] == 0 and p.stats()["backup_held"] == st["backup_held"]
            assert p.tags()["train"]["backup_held"] == st["backup_held"] and p.tags()["kv"]["backup_held"] == 0
            p.empty_cache()  # device memory only (verl calls it around every offload): the buffer stays
            p.check()
        held = p.stats()["backup_held"]
        assert pinned() == (1, 0)  # one buffer, three pauses
        # one lookup for a pause (its synchronisation), one for a resume: none per copied block
        assert looked_up <= 2 * 3
        # more to back up: a larger buffer replaces the kept one
        with p.region("train"):
            extra = p.malloc(2 * MiB)
        _fill(extra, 2 * MiB, 9)
        p.pause("train", backup=True)
        assert pinned() == (2, 1) and p.stats()["backup_held"] > held
        p.resume("train")
        assert _holds(extra, 2 * MiB, 9) and _holds(blocks[0], sizes[0], 10)
        # a pause the bound refuses even with every kept buffer given back gives none back
        held = p.stats()["backup_held"]
        p.set_backup_limit(held + MiB)
        with p.region("kv"):
            big = p.malloc(held + 2 * MiB)
        with pytest.raises(OutOfMemoryError, match="pause of tag 'kv'.*backup bound.*nothing was paused"):
            p.pause("kv", backup=True)
        assert p.tags()["train"]["backup_held"] == held and pinned() == (2, 1)
        p.free(big)
        # another tag's pause under a bound the kept buffer fills: the kept buffer goes back first
        p.set_backup_limit(held)
        _fill(kv, 4 * MiB, 77)
        p.pause("kv", backup=True)
        assert p.tags()["train"]["backup_held"] == 0 and p.stats()["backup_held"] == p.tags()["kv"]["backup_held"]
        p.resume("kv")
        assert _holds(kv, 4 * MiB, 77)
        # a lower bound gives back what holds no backup, not a paused tag's backup
        p.set_backup_limit(1 << 40)
        p.pause("train", backup=True)
        p.set_backup_limit(MiB)
        assert p.stats()["backup_held"] == p.tags()["train"]["backup_held"] > 0 and p.tags()["kv"]["backup_held"] == 0
        p.resume("train")
        assert _holds(extra, 2 * MiB, 9)
        p.set_backup_limit(0)
        assert p.stats()["backup_held"] == 0 and pinned()[0] == pinned()[1]
        p.set_backup_limit(1 << 40)
        p.pause("train", backup=True)
        p.resume("train")
        assert pinned()[0] == pinned()[1] + 1
        p.check()
    assert pinned()[0] == pinned()[1]  # close gives back every buffer


def test_a_restore_the_device_refuses_is_an_out_of_memory_event(builds: dict, tmp_path) -> None:  # noqa: F811
    v = _vendor(builds, "cuda", capacity=128 * MiB)
    with v.pool() as p:
        with p.region("train"):
            w = p.malloc(6 * MiB)
        _fill(w, 6 * MiB, 4)
        p.pause("train", backup=True)
        v.lib.fake_fail(b"cudaMemcpy", 0, 1, 2)  # cudaErrorMemoryAllocation
        ooms = p.stats()["ooms"]
        with pytest.raises(OutOfMemoryError, match="restoring its backup failed"):
            p.resume("train")
        x = oom.explain(p)
        assert p.stats()["ooms"] == ooms + 1 and (x.kind, x.request) == ("device", p.tags()["train"]["paused"])
        assert p.tags()["train"]["is_paused"] and p.stats()["backup"] > 0
        # its compaction figure is not counted (UINT64_MAX), which the OOM snapshot's .json writes as null
        assert [e["compactable"] for e in p.history() if e["kind"] == "oom"][-1] == (1 << 64) - 1
        doc = json.loads(oom.write_snapshot(p, tmp_path).with_suffix(".json").read_text())
        assert [e["compactable"] for e in doc["history"] if e["kind"] == "oom"][-1] is None
        p.check()
        p.resume("train")
        assert _holds(w, 6 * MiB, 4)
        p.check()


@pytest.mark.parametrize("backend", ["acl", "cuda"])
@pytest.mark.parametrize("op", ["map", "create", "unmap"])
def test_vendor_failing_half_way_leaves_the_books_right(builds: dict, backend: str, op: str) -> None:  # noqa: F811
    v = _vendor(builds, backend, capacity=128 * MiB)
    with v.pool() as p:
        with p.region("train"):
            a = p.malloc(20 * MiB - v.pad)
            c = p.malloc(4 * MiB - v.pad)
            b = p.malloc(10 * MiB - v.pad)
        p.free(c)  # two runs of allocated blocks: a resume maps two chunks, a pause unmaps two
        p.pause("train")
        p.resume("train")  # from here on the tag's chunks are its runs, the same at every cycle
        # count the vendor calls of one cycle, then fail the last call of that kind in the next one,
        # so that the failure lands half-way: after earlier calls of the same kind succeeded
        before = v.calls(op)
        p.pause("train")
        in_pause = v.calls(op) - before
        p.resume("train")
        in_resume = v.calls(op) - before - in_pause
        if op == "unmap":  # a chunk that refuses to unmap is held, counted, and retried
            assert in_pause == 2 and in_resume == 0  # one unmap per chunk: the two runs resume mapped
            v.fail(op, skip=in_pause - 1, count=3)  # and again when the resume retries it, and before it maps there
            with pytest.raises(PoolError):
                p.pause("train")
            assert v.calls(op) - before == 2 * in_pause  # every chunk was tried
            assert p.tags()["train"]["is_paused"] and p.stats()["unreleased"] > 0
            p.check()  # (reserved counts the held chunk: the device still has it)
            assert p.stats()["total"]["reserved"]["current"] == v.lib.fake_used()
            # the chunk still mapped at the tag's address blocks the resume: an error, nothing mapped
            with pytest.raises(PoolError, match="resume of tag 'train'.*still holds"):
                p.resume("train")
            assert p.tags()["train"]["is_paused"] and p.mapped_ranges() == []
        else:
            assert in_pause == 0 and in_resume == 2  # one chunk per run of allocated blocks
            p.pause("train")
            v.fail(op, skip=in_resume - 1)  # the chunks mapped before the failure are undone
            with pytest.raises(PoolError, match="resume of tag 'train'"):
                p.resume("train")
            assert v.calls(op) - before == 2 * in_resume
            assert p.tags()["train"]["is_paused"] and p.tags()["train"]["mapped"] == 0
            assert p.mapped_ranges() == []
        p.check()
        assert p.stats()["total"]["reserved"]["current"] == v.lib.fake_used()
        # the resume first returns the chunk the pause could not (still mapped at the tag's address)
        assert p.resume("train") == 30 * MiB and p.stats()["unreleased"] == 0
        _fill(a, 20 * MiB - v.pad, 1)
        _fill(b, 10 * MiB - v.pad, 2)
        p.check()
        assert p.stats()["total"]["reserved"]["current"] == v.lib.fake_used()


@pytest.mark.parametrize("backend", ["acl", "cuda"])
def test_a_pause_counts_what_the_device_got_back_and_says_when_it_fails(builds: dict,  # noqa: F811
                                                                       backend: str) -> None:
    """From a review (2026-11-27, a helper): a pause whose chunk release the device refused said it
    gave back that chunk's bytes, where the device's used bytes and reserved had not moved (a
    caller sizing a rollout's cache from it runs out); a pause whose unmap failed raised the
    vendor's bare error, and the tag was paused all the same."""
    v = _vendor(builds, backend, capacity=128 * MiB)
    with v.pool() as p:
        with p.region("train"):
            a = p.malloc(20 * MiB - v.pad)
            b = p.malloc(30 * MiB - v.pad)
        _fill(a, 20 * MiB - v.pad, 1)
        _fill(b, 30 * MiB - v.pad, 2)
        backup = backend == "cuda"  # (the fake ACL copies nothing to the host)
        for op in ("release", "unmap"):
            used, mapped = v.lib.fake_used(), p.tags()["train"]["mapped"]
            v.fail(op)  # the first chunk's
            if op == "release":
                got = p.pause("train", backup=backup)
                assert got == used - v.lib.fake_used() < mapped and p.stats()["unreleased"] == mapped - got > 0
            else:
                with pytest.raises(PoolError, match="pause of tag 'train': .* failed.*the tag is paused all the "
                                                    "same.*resume it before" + (".*resume restores" if backup else "")):
                    p.pause("train", backup=backup)
                assert p.tags()["train"]["is_paused"] and p.stats()["unreleased"] > 0
            assert p.stats()["total"]["reserved"]["current"] == v.lib.fake_used()
            p.check()
            p.resume("train")
            assert p.stats()["unreleased"] == 0 and p.tags()["train"]["mapped"] == mapped
            assert not backup or (_holds(a, 20 * MiB - v.pad, 1) and _holds(b, 30 * MiB - v.pad, 2))
            assert p.stats()["total"]["reserved"]["current"] == v.lib.fake_used()
            p.check()


@pytest.fixture(scope="module")
def fake_cuda(tmp_path_factory: pytest.TempPathFactory) -> str:
    cc = _compiler()
    if cc is None:
        unavailable("no C compiler to build the fake vendor libraries")
    path = tmp_path_factory.mktemp("fake_cuda") / "libfake_cuda_colocate.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(path), str(FAKES / "fake_cuda.c"), "-lpthread"],
                   check=True, capture_output=True)
    return str(path)


def test_through_the_pluggable_entry_points_on_fake_cuda(fake_cuda: str) -> None:
    inst._reset()
    v = Vendor("cuda", fake_cuda, ctypes.CDLL(fake_cuda))
    v.lib.fake_set_capacity(128 * MiB)
    try:
        assert so.npu_pool_configure(POLICIES["npu_pool"], BACKENDS["cuda"], 1.0, 1, fake_cuda.encode()) == 0
        pool = inst._DevicePool(0, "npu_pool", "cuda")
        with pool.region("train"):
            w = int(ffi.cast("uintptr_t", so.npu_pool_malloc(80 * MiB, 0, ffi.NULL)))
        assert w
        _fill(w, 80 * MiB, 0x5A)
        assert not so.npu_pool_malloc(80 * MiB, 0, ffi.NULL)  # no room for both
        used = v.lib.fake_used()
        assert pool.pause("train", backup=True) == 80 * MiB and v.lib.fake_used() == used - 80 * MiB
        kv = so.npu_pool_malloc(80 * MiB, 0, ffi.NULL)
        assert kv
        so.npu_pool_free(kv, 0, 0, ffi.NULL)  # idle in the pool: resume returns it first
        assert pool.resume("train") == 80 * MiB
        assert _holds(w, 80 * MiB, 0x5A) and v.lib.fake_used() == 80 * MiB
        pool.check()
        so.npu_pool_free(ffi.cast("void *", w), 0, 0, ffi.NULL)
    finally:
        inst._reset()


# ---- traces and replays --------------------------------------------------------------------------

def _cycle_trace(cycles: int = 3) -> Trace:
    t = Trace()
    ids = 0
    t.append(OP_REGION, id=0)
    weights = []
    for _ in range(4):
        t.append(OP_ALLOC, id=ids, size=24 * MiB); weights.append(ids); ids += 1
    t.append(OP_REGION, id=-1)
    for _ in range(cycles):
        t.append(OP_PAUSE, id=0, cat=1)
        kv = []
        for k in range(10):
            t.append(OP_ALLOC, id=ids, size=(7 + k) * MiB + 4096); kv.append(ids); ids += 1
        for k, i in enumerate(kv):
            t.append(OP_FREE, id=i, size=(7 + k) * MiB + 4096)
        t.append(OP_RESUME, id=0)
        t.append(OP_REGION, id=0)
        g = ids
        t.append(OP_ALLOC, id=g, size=5 * MiB); ids += 1
        t.append(OP_FREE, id=g, size=5 * MiB)
        t.append(OP_REGION, id=-1)
    t.meta["n_ids"] = ids
    return t


def test_trace_ops_are_validated() -> None:
    t = _cycle_trace(1)
    t.validate()
    for bad in ([(OP_RESUME, 0)], [(OP_PAUSE, 0), (OP_PAUSE, 0)], [(OP_PAUSE, 40)], [(OP_REGION, -2)]):
        u = Trace()
        for op, i in bad:
            u.append(op, id=i)
        with pytest.raises(TraceError):
            u.validate()
    u = Trace()
    u.append(OP_REGION, id=1); u.append(OP_PAUSE, id=1); u.append(OP_ALLOC, id=0, size=10)
    u.meta["n_ids"] = 1
    with pytest.raises(TraceError, match="paused"):
        u.validate()


def test_replay_pauses_with_npu_pool_and_offloads_with_the_others() -> None:
    t = _cycle_trace(4)
    kv = sum((7 + k) * MiB + 4096 for k in range(10))
    cap = 140 * MiB  # less than the weights (96 MiB) and the rollout's KV cache together
    res = {pol: replay.run(t, pol, cap) for pol in ("npu_pool", "torch", "expandable")}
    # paused (npu_pool) or offloaded (the others): the weights leave the device while the rollout runs
    assert res["npu_pool"].peak_reserved_bytes < 96 * MiB + kv
    assert res["npu_pool"].stats["paused"] == 0 and res["npu_pool"].stats["ooms"] == 0
    assert res["npu_pool"].ok and res["expandable"].ok
    assert res["npu_pool"].peak_live_bytes == res["expandable"].peak_live_bytes
    assert res["npu_pool"].peak_reserved_bytes <= res["expandable"].peak_reserved_bytes


# ---- the real torch_npu over the fake CANN runtime --------------------------------------------------

def test_torch_npu_pause_frees_the_device_and_resume_restores_pointers_and_contents(torch_npu) -> None:
    out, err = torch_npu.results("""
import ctypes, json
fake = ctypes.CDLL("libascendcl.so")
fake.fake_used.restype = ctypes.c_ulonglong
import torch, torch_npu, npu_pool
npu_pool.install()
MiB = 1 << 20
r = {}
host = torch.arange(150 * MiB, dtype=torch.int64).remainder(251).to(torch.uint8)
with npu_pool.region("train"):
    w = host.to("npu")
    small = torch.full((1000,), 7, dtype=torch.int32).to("npu")   # (no kernels run here: copies only)
ptrs = [w.data_ptr(), small.data_ptr()]
try:                                   # the device cannot hold the weights and as much again
    torch.empty(150 * MiB, dtype=torch.uint8, device="npu")
    r["both_fit"] = True
except torch.OutOfMemoryError:
    r["both_fit"] = False
torch.npu.empty_cache()
used, reserved = fake.fake_used(), torch.npu.memory_reserved()
free_before = torch.npu.mem_get_info()[0]
paused = npu_pool.pause("train", backup=True)
r["paused"] = paused
r["used_drop"] = used - fake.fake_used()
r["reserved_drop"] = reserved - torch.npu.memory_reserved()
r["free_rise"] = torch.npu.mem_get_info()[0] - free_before
st = npu_pool.installed()[0].stats()
r["stats"] = [st["paused"], st["backup"], npu_pool.colocate.tags()["train"]["is_paused"]]
kv = torch.empty(paused, dtype=torch.uint8, device="npu")   # as large as the paused bytes: fits now
kv.copy_(torch.full((paused,), 3, dtype=torch.uint8))
r["kv_ok"] = bool((kv.cpu() == 3).all())
del kv                                  # idle in the pool: resume gives it back first
try:
    with npu_pool.region("train"):
        torch.empty(10, device="npu")
    r["alloc_paused"] = "allowed"
except RuntimeError as e:
    r["alloc_paused"] = "paused; resume it first" in str(e)
r["resumed"] = npu_pool.resume("train")
r["same_ptrs"] = [w.data_ptr(), small.data_ptr()] == ptrs
r["contents"] = bool(torch.equal(w.cpu(), host)) and bool((small.cpu() == 7).all())
p = npu_pool.installed()[0]
p.check()
r["books"] = [p.stats()["total"]["reserved"]["current"], fake.fake_used(), torch.npu.memory_reserved()]
try:
    npu_pool.resume("train")
except RuntimeError as e:
    r["resume_twice"] = str(e)
print(json.dumps(r))
""", FAKE_CAPACITY=str(256 << 20))
    MiB_ = 1 << 20
    assert out["both_fit"] is False
    assert out["paused"] >= 150 * MiB_
    assert out["used_drop"] == out["reserved_drop"] == out["free_rise"] == out["paused"]
    assert out["stats"][0] >= 150 * MiB_ and out["stats"][1] >= 150 * MiB_ and out["stats"][2]
    assert out["kv_ok"] and out["alloc_paused"] is True
    assert out["resumed"] == out["stats"][0]
    assert out["same_ptrs"] and out["contents"]
    assert out["books"][0] == out["books"][2] and out["books"][1] >= out["books"][0]
    assert "not paused" in out["resume_twice"]


def test_the_gpu_colocate_benchmark_runs_under_torch_npu(torch_npu, tmp_path) -> None:
    """benchmarks/gpu_colocate.py (docs/gpu.md, "Colocated RL on the H100") over the fake CANN,
    copies only: under both allocators the trainer comes back whole, under npu_pool at the same
    addresses, and the ballast keeps the trainer and the KV cache from fitting together."""
    out = tmp_path / "r.json"
    r = torch_npu.run(f"import runpy, sys; sys.path.insert(0, 'benchmarks'); sys.argv = ['gpu_colocate.py', '--device', 'npu', '--no-train', '--dim', '256', "
                      f"'--layers', '2', '--vocab', '4096', '--cycles', '3', '--margin-mib', '0', '--json', {str(out)!r}]; "
                      "runpy.run_path('benchmarks/gpu_colocate.py', run_name='__main__')", timeout=600)
    assert r.returncode == 0 and "checks: passed" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    p, n = res["npu_pool"], res["native"]
    assert not p["both_fit"] and not n["both_fit"] and p["trainer_bytes"] == n["trainer_bytes"] > 0
    assert all(c["contents_same"] for c in p["cycles"] + n["cycles"])
    assert {c["tensors_moved"] for c in p["cycles"]} == {0} and n["cycles"][0]["tensors_moved"] == n["cycles"][0]["tensors"]
    assert p["calls"]["get_device"] < p["cycles"][0]["tensors"]  # not one per copied tensor


def test_colocated_capture_replays_without_growth_from_cycle_to_cycle() -> None:
    from npu_pool.capture.colocated import TAGS, colocated_capture, cycle_bounds, resident

    t = colocated_capture(cycles=4, layers=2, seq=256, rollout_batch=8, prompt=64, response=64, decode_steps=4)
    bounds = cycle_bounds(t)
    assert len(bounds) == 4 and t.meta["capture"]["tags"] == TAGS

    def first(k: int) -> Trace:
        u = Trace(meta=dict(t.meta))
        for col in ("op", "cat", "site", "id", "size", "stream", "addr"):
            getattr(u, col).extend(getattr(t, col)[:bounds[k - 1][1]])
        u.meta["n_ids"] = sum(1 for op in u.op if op == OP_ALLOC)
        return u

    caps = [replay.min_capacity(first(k), "npu_pool", lo=PAGE)[0] for k in (1, 4)]
    assert caps[0] == caps[1]  # no memory lost to fragmentation cycle after cycle
    kept = replay.min_capacity(resident(t), "npu_pool", lo=PAGE)[0]
    assert caps[1] < kept  # pausing frees what the other side needs
    r = replay.run(t, "npu_pool", caps[1])
    assert r.ok and r.stats["paused"] > 0  # ends with the trainer paused
    # peak live counts a paused tag's tensors off the device, in the replay (C) and in Python alike
    from npu_pool.trace.stats import live_profile

    assert r.peak_live_bytes == live_profile(t).peak_bytes <= caps[1]
    assert live_profile(resident(t)).peak_bytes > r.peak_live_bytes


def test_capture_command_colocated_needs_a_shape(capsys: pytest.CaptureFixture) -> None:
    from npu_pool.cli import main

    assert main(["capture", "--colocated", "3"]) == 2
    assert "--colocated needs --shape" in capsys.readouterr().err
    # a colocated capture models one training step of its own: what it would ignore is refused
    assert main(["capture", "--shape", "7b", "--colocated", "3", "--recompute", "--steps", "5"]) == 2
    assert "--colocated takes --shape, --model, --tp, --batch, --seq and --layers; not --steps, --recompute" in \
        capsys.readouterr().err


def test_an_out_of_memory_inside_a_region_names_its_room_beside_the_cap() -> None:
    """A tagged region's arena may hold the cap less what the rest of the pool holds: its refusal
    said that room was 'the memory fraction cap' (24 MiB, beside the 1 GiB cap in the same line)."""
    with Pool("npu_pool", capacity=1 << 30) as p:
        keep = [p.malloc(100 * MiB) for _ in range(10)]
        with pytest.raises(OutOfMemoryError) as e:
            with p.region("t"):
                p.malloc(30 * MiB)
        text = str(e.value)
        assert "would exceed the 24.00 MiB this arena may hold (the memory fraction cap of 1.00 GiB" in text, text
        assert "memory fraction cap of 24.00 MiB" not in text
        for x in keep:
            p.free(x)
        p.check()


def test_an_out_of_memory_while_a_tag_is_paused_says_what_the_pause_holds() -> None:
    """A paused tag's tensors stay allocated with no memory behind them: an out-of-memory message
    said 'reserved 302 MiB ... allocated 800 MiB' and nothing of the pause; it names the paused
    bytes now."""
    with Pool("npu_pool", capacity=1 << 30) as p:
        with p.region("rollout"):
            kept = p.malloc(500 * MiB)
        p.pause("rollout")
        with pytest.raises(OutOfMemoryError) as e:
            p.malloc(2 << 30)
        assert "of the allocated, 500.00 MiB is in paused tagged regions (no memory behind it until resume)" in \
            str(e.value), str(e.value)
        p.resume("rollout")
        p.free(kept)
        p.check()


def test_resuming_a_tag_with_nothing_to_map_never_fails_on_the_cap() -> None:
    """A paused tag whose tensors were all freed maps nothing at its resume: over a lowered cap it
    failed ('mapping 0 bytes more would pass the memory fraction cap'), counted an out-of-memory
    and stayed paused (found by a helper's fuzzing on a debug build)."""
    with Pool("npu_pool", capacity=100 * MiB) as p:
        with p.region("b"):
            x = p.malloc(MiB)
        p.pause("b")
        p.free(x)
        with p.region("empty"):
            pass
        p.pause("empty")  # a tag never allocated into
        big = p.malloc(60 * MiB)
        p.set_fraction(0.5)  # the pool now holds more than the cap
        p.resume("b")
        p.resume("empty")
        assert p.stats()["ooms"] == 0 and not any(t["is_paused"] for t in p.tags().values())
        p.free(big)
        _books_match(p)


def test_an_out_of_memory_names_the_idle_memory_other_regions_keep_mapped() -> None:
    """Each tag's arena maps its own chunks: a 512-byte tensor keeps its 20 MiB chunk, which
    empty_cache cannot return. The message said 'a real shortage ... lower the batch' with 1 KiB
    allocated and 40 MiB reserved; it is fragmentation across regions, naming the memory they keep."""
    with Pool("npu_pool", capacity=64 * MiB) as p:
        with p.region("train"):
            a = p.malloc(512)
        with p.region("rollout"):
            b = p.malloc(512)
        p.empty_cache()
        with pytest.raises(OutOfMemoryError) as e:
            p.malloc(30 * MiB)
        text = str(e.value)
        idle = p.stats()["total"]["reserved"]["current"] - 1024
        assert "fragmentation across tagged regions: the arena has only 24.00 MiB it could use" in text, text
        assert f"{idle / MiB:.2f} MiB more is free in the pool's other arenas (untagged tensors' and other " \
               "regions'), kept mapped by their live tensors (empty_cache cannot return it: free those tensors, " \
               "or pause those regions)" in text, text
        assert "a real shortage" not in text
        x = oom.explain(p)  # the explanation says the same, with the regions that keep the memory
        (tip,) = [s for s in x.suggestions if "other arenas" in s]
        assert x.kind == "fragmentation" and "train: 20.00 MiB" in tip and "rollout: 20.00 MiB" in tip, tip
        # inside a region: the region itself is not "other", the untagged tensors' arena is
        with p.region("train"):  # (its own 20 MiB chunk and the cap's 24 serve 30 MiB here; not 50)
            with pytest.raises(OutOfMemoryError):
                p.malloc(50 * MiB)
            tips = oom.explain(p).suggestions  # (as the OOM snapshot's, written at the failure)
        (tip,) = [s for s in tips if "other arenas" in s]
        assert "rollout: 20.00 MiB" in tip and "train" not in tip, tip
        p.pause("train")
        p.pause("rollout")
        p.free(p.malloc(30 * MiB))  # paused, they hold nothing
        p.resume("train")
        p.resume("rollout")
        p.free(a)
        p.free(b)
        _books_match(p)
