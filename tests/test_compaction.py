"""Compaction (``Pool.set_compaction``): at an out-of-memory, a chunk that holds live blocks and
free pages is replaced by chunks over its live pages, their bytes copied through host memory at
the same addresses; what the device refuses half-way leaves the books matching the device and
the bytes where they were, or says plainly that they are lost (docs/api.md)."""
from __future__ import annotations

import contextlib
import ctypes
import json
import random
import threading
from typing import Callable

import pytest

from conftest import cann
from npu_pool import vocab
from npu_pool.pool import BackendError, InvalidArgumentError, OutOfMemoryError, Pool, PoolError
from test_backends import MiB, Vendor, builds  # noqa: F401 (builds: the fixture)
from test_faults import _books_match as books, _clear_faults, _free_one, _written

@pytest.fixture(scope="module")
def fakes(builds: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:  # noqa: F811
    """The fake vendor libraries that copy: CUDA's, and for ACL the fake CANN runtime (the plain
    fake ACL has no aclrtMemcpy, tests/test_colocate.py)."""
    try:
        acl = str(cann.build(tmp_path_factory.mktemp("cann")) / "libascendcl.so")
    except cann.BuildError as e:
        pytest.skip(f"the fake CANN runtime could not be built: {e}")
    return {"acl": acl, "cuda": builds[("cuda", "full")]}


def _vendor(fakes: dict, backend: str) -> Vendor:
    v = Vendor(backend, fakes[backend], ctypes.CDLL(fakes[backend]))
    v.lib.fake_set_capacity(256 * MiB)
    return v


BLOCK = 25 * MiB  # ten of them on a 256 MiB device share pages (25 MiB is 12.5 pages of 2 MiB)
KINDS = ("phys_create", "phys_release", "map", "unmap")


def _pinned(p: Pool, fill: bool, alloc: Callable[[int], int] | None = None) -> dict[int, int]:
    """Ten blocks (``alloc``, default ``p.malloc``), every other one freed and empty_cache: the freed
    ones' pages stay mapped in chunks that live blocks hold. Returns the live blocks (address -> the
    byte they are filled with)."""
    ptrs = [(alloc or p.malloc)(BLOCK) for _ in range(10)]
    for x in ptrs[::2]:
        p.free(x)
    p.empty_cache()
    live = {x: 0x41 + i for i, x in enumerate(ptrs[1::2])}
    if fill:
        for x, byte in live.items():
            ctypes.memset(x, byte, BLOCK)
    return live


def _intact(live: dict[int, int]) -> bool:
    return all(ctypes.string_at(x, BLOCK) == bytes([byte]) * BLOCK for x, byte in live.items())


def _fill(p: Pool, size: Callable[[], int]) -> list[int]:
    """Requests of ``size()`` bytes until one fails; the addresses served."""
    ptrs: list[int] = []
    with pytest.raises(OutOfMemoryError):
        while True:
            ptrs.append(p.malloc(size()))
    return ptrs


def _books_match(p: Pool, v) -> None:
    p.check()
    assert p.stats()["total"]["reserved"]["current"] == v.lib.fake_used()


@pytest.mark.parametrize("backend", ["acl", "cuda"])
def test_compaction_serves_a_request_pinned_pages_refused_and_keeps_the_bytes(fakes: dict, backend: str) -> None:
    v = _vendor(fakes, backend)
    with v.pool() as p:  # without compaction the request fails: every freed block's pages are pinned
        _pinned(p, fill=False)
        with pytest.raises(OutOfMemoryError):
            p.malloc(3 * BLOCK)
    v.lib.fake_reset()
    v.lib.fake_set_capacity(256 * MiB)
    with v.pool(compact=True) as p:
        live = _pinned(p, fill=True)
        copies = v.lib.fake_calls(b"aclrtMemcpy" if backend == "acl" else b"cudaMemcpy")
        big = p.malloc(3 * BLOCK)
        ctypes.memset(big, 0x7F, 3 * BLOCK)  # its pages are mapped: writing them would fault otherwise
        assert _intact(live), "a compaction lost live bytes"
        st = p.stats()
        assert st["compactions"] >= 1 and 0 < st["compacted"] <= 5 * BLOCK + 10 * 2 * MiB
        moved = v.lib.fake_calls(b"aclrtMemcpy" if backend == "acl" else b"cudaMemcpy") - copies
        assert moved >= 2 * st["compactions"]  # out and back, a run at a time
        _books_match(p, v)
        ours = {k: st["calls"][k] for k in KINDS}
        vendor = {k: v.lib.fake_calls(vocab.CALL_VENDOR[backend][k].encode()) for k in KINDS}
        assert ours == vendor
    # the simulator under that vendor's rules makes the same calls for the same requests
    with Pool("npu_pool", capacity=256 * MiB, rules="npu" if backend == "acl" else "cuda", compact=True) as p:
        _pinned(p, fill=False)
        p.malloc(3 * BLOCK)
        sim = p.stats()
        assert {k: sim["calls"][k] for k in KINDS} == ours
        assert (sim["compactions"], sim["compacted"]) == (st["compactions"], st["compacted"])


@pytest.mark.parametrize("backend", ["acl", "cuda"])
@pytest.mark.parametrize("op, skip", [("copy", 0), ("unmap", 0), ("create", 0), ("release", 0), ("copy", 1)])
def test_a_vendor_call_failing_once_loses_no_byte(fakes: dict, backend: str, op: str, skip: int) -> None:
    """A copy out or an unmap that fails leaves that chunk as it was (the request may still fail);
    a chunk the device refuses to take back maps again where it was; a creation refused once is
    asked again (the device took the whole chunk back a moment before); a copy back, tried again."""
    v = _vendor(fakes, backend)
    with v.pool(compact=True) as p:
        live = _pinned(p, fill=True)
        copy = "aclrtMemcpy" if backend == "acl" else "cudaMemcpy"
        if op == "copy":
            v.lib.fake_fail(copy.encode(), skip, 1, 507899 if backend == "acl" else 999)
        else:
            v.fail(op, skip=skip, count=1)
        try:
            p.free(p.malloc(3 * BLOCK))
        except OutOfMemoryError:
            assert op not in ("create", "copy") or skip == 0 and op == "copy", "refused once: asked again"
        assert _intact(live)
        _books_match(p, v)
        p.malloc(MiB)  # the pool goes on
    assert v.lib.fake_used() == 0


@pytest.mark.parametrize("backend", ["acl", "cuda"])
@pytest.mark.parametrize("op", ["create", "copy back"])
@pytest.mark.parametrize("by", ["a request", "compact()"])
def test_bytes_that_cannot_be_put_back_are_reported_lost(fakes: dict, backend: str, op: str, by: str) -> None:
    v = _vendor(fakes, backend)
    p = v.pool(compact=True)
    _pinned(p, fill=True)
    copy = ("aclrtMemcpy" if backend == "acl" else "cudaMemcpy").encode()
    if op == "create":
        v.fail("create", count=1000)  # the device refuses the live pages' chunks, twice
    else:  # every copy fails once the first chunk's bytes are out: each chunk here has one run of live pages
        v.lib.fake_fail(copy, 1, 1000, 507899 if backend == "acl" else 999)
    with pytest.raises(PoolError, match="could not put its .* of live bytes back") as e:
        p.malloc(3 * BLOCK) if by == "a request" else p.compact()
    assert not isinstance(e.value, OutOfMemoryError)
    assert p.stats()["total"]["reserved"]["current"] == v.lib.fake_used()  # stats still answer
    with pytest.raises(PoolError, match="a compaction could not put live tensors' bytes back"):
        p.malloc(MiB)
    v.fail("create", count=0)
    v.lib.fake_fail(copy, 0, 0, 0)
    p.close()
    assert v.lib.fake_used() == 0 and v.lib.fake_live() == 0


def _churn(p: Pool, seed: int, most: int, errors: list[BaseException]) -> None:
    """400 random requests and frees of one thread (at most ``most`` blocks held), touching no
    memory; whatever it raises but an out-of-memory goes to ``errors``."""
    rng = random.Random(seed)
    mine: list[int] = []
    try:
        for _ in range(400):
            if mine and (len(mine) > most or rng.random() < 0.45):
                p.free(mine.pop(rng.randrange(len(mine))))
            else:
                try:
                    mine.append(p.malloc(rng.choice([300_000, 3 * MiB + 5, 9 * MiB, 17 * MiB])))
                except OutOfMemoryError:
                    pass
        for x in mine:
            p.free(x)
    except BaseException as ex:  # noqa: BLE001 - the test reports it
        errors.append(ex)


def test_threads_allocating_while_one_compacts_keep_the_books() -> None:
    """Compaction runs under the pool's lock: four threads allocating and freeing on a tight device
    (no device work queued by others: the contract) leave every invariant and the stats whole."""
    with Pool("npu_pool", capacity=128 * MiB, compact=True) as p:
        errors: list[BaseException] = []
        threads = [threading.Thread(target=_churn, args=(p, s, 10, errors)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        p.check()
        st = p.stats()
        assert st["total"]["allocated"]["current"] == 0 and st["compactions"] > 0


def test_set_compaction_says_where_it_cannot_apply() -> None:
    with pytest.raises(PoolError, match="policy torch does not compact"):
        Pool("torch", capacity=64 * MiB, compact=True)
    with pytest.raises(PoolError, match="needs the virtual-memory API"):
        Pool("npu_pool", capacity=64 * MiB, vmm=False, compact=True)
    with pytest.raises(InvalidArgumentError):
        Pool("npu_pool", capacity=64 * MiB, compact="yes")
    p = Pool("planned", capacity=64 * MiB, compact=True)  # its fallback arena compacts
    p.set_compaction(False)
    p.close()
    with pytest.raises(PoolError, match="closed pool"):
        p.set_compaction(True)


def test_without_compaction_nothing_changes() -> None:
    """Off (the default) the arena is the one without the feature: no compaction; the
    out-of-memory message says how much compaction would give back (what compact() then gives
    back). On, a request past the cap even so does not say it; nor does a pool that cannot
    compact."""
    with Pool("npu_pool", capacity=256 * MiB) as p:
        _pinned(p, fill=False)
        with pytest.raises(OutOfMemoryError, match=r"compaction would give back ([0-9.]+) MiB, the free pages live "
                                                   r"tensors' chunks keep mapped \(Pool.compact\(\) where no other "
                                                   r"thread queues device work, or at every out-of-memory: "
                                                   r"Pool.set_compaction, NPU_POOL_COMPACT=1") as e:
            p.malloc(3 * BLOCK)
        assert p.stats()["compactions"] == 0 == p.stats()["compacted"]
        said = float(str(e.value).split("compaction would give back ")[1].split(" MiB")[0])
        assert p.compact() == said * MiB > 0
    with Pool("npu_pool", capacity=256 * MiB, vmm=False) as p:
        _pinned(p, fill=False)
        with pytest.raises(OutOfMemoryError) as e:
            p.malloc(3 * BLOCK)
        assert "compaction would" not in str(e.value)
    with Pool("npu_pool", capacity=256 * MiB, compact=True) as p:
        _pinned(p, fill=False)
        with pytest.raises(OutOfMemoryError) as e:
            p.malloc(7 * BLOCK)
        assert "compaction would" not in str(e.value)


def test_the_rank_report_counts_compactions_and_the_bytes_moved() -> None:
    """A training run with compaction on sees it in its per-iteration line and its rank report
    (recorder.report.memory_of): how many chunks were replaced and how many live bytes moved, the
    cost the device-call counts leave out. Nothing is said while none happened."""
    from npu_pool.recorder import report

    with Pool("npu_pool", capacity=256 * MiB, compact=True) as p:
        live = _pinned(p, fill=False)
        quiet = report.format_line({"rank": 0, "step_seconds": {}, "memory": report.memory_of(p.stats())}, 1)
        big = p.malloc(3 * BLOCK)
        st, mem = p.stats(), report.memory_of(p.stats())
        line = report.format_line({"rank": 0, "step_seconds": {}, "memory": mem}, 2)
        p.free(big)
        for x in live:
            p.free(x)
    assert "compactions" not in quiet
    assert mem["compactions"] == st["compactions"] > 0 and mem["compacted"] == st["compacted"] > 0
    assert f"compactions {st['compactions']} ({st['compacted'] / (1 << 30):.2f} GiB moved)" in line


_COPY = {"acl": b"aclrtMemcpy", "cuda": b"cudaMemcpy"}


def _steps(seed: int) -> list[tuple]:
    """A random sequence that presses a 64 MiB device: mostly requests, some frees, faults now and then."""
    rng = random.Random(seed)
    out: list[tuple] = []
    for _ in range(150):
        x = rng.random()
        if x < 0.55:
            out.append(("alloc", rng.choice([1000, 300_000, 2 * MiB + 3, 3 * MiB + 5, 7 * MiB, 9 * MiB, 13 * MiB]),
                        rng.choice(["long", "short"])))
        elif x < 0.85:
            out.append(("free", rng.randrange(1000)))
        elif x < 0.9:
            out.append(("empty_cache",))
        else:
            out.append(("fault", rng.choice(["create", "map", "unmap", "release", "copy"]), rng.randrange(4),
                        rng.randrange(1, 3)))
    return out


@pytest.mark.parametrize("backend", ["acl", "cuda"])
def test_random_requests_and_vendor_faults_with_compaction(fakes: dict, backend: str) -> None:
    """As tests/test_faults.py, on a device small enough that compaction runs: after every step the
    books match the device and every live block holds what was written to it (its first and last
    bytes), or the pool said its bytes were lost and refuses every call."""
    compacted = lost = 0
    for seed in range(40):
        outcome = _play(fakes, backend, _steps(seed))
        compacted += outcome == "compacted"
        lost += outcome == "lost"
    assert compacted >= 10, compacted  # (the sequences do press the device)


def _play(fakes: dict, backend: str, seq: list) -> str:
    v = _vendor(fakes, backend)
    v.lib.fake_set_capacity(64 * MiB)
    p = v.pool(compact=True)
    live: dict[int, tuple[int, int]] = {}
    code = 507899 if backend == "acl" else 999
    outcome = "none"

    def tails_intact() -> None:
        for ptr, (size, byte) in live.items():
            n = min(size, 64)
            assert ctypes.string_at(ptr + size - n, n) == bytes([byte]) * n, "a compaction lost live bytes"

    try:
        for step in seq:
            if step[0] == "alloc":
                try:
                    ptr = p.malloc(step[1], lifetime=step[2])
                except (OutOfMemoryError, BackendError):
                    pass
                except PoolError as e:
                    assert "could not put" in str(e), e
                    with pytest.raises(PoolError, match="a compaction could not put"):
                        p.malloc(1000)
                    return "lost"
                else:
                    _written(live, ptr, step[1])
                    ctypes.memset(ptr + step[1] - min(step[1], 64), live[ptr][1], min(step[1], 64))
            elif step[0] == "free" and live:
                _free_one(p, live, step[1])
            elif step[0] == "empty_cache":
                try:
                    p.empty_cache()
                except BackendError:
                    pass
            elif step[0] == "fault":
                _, op, skip, count = step
                if op == "copy":
                    v.lib.fake_fail(_COPY[backend], skip, count, code)
                else:
                    v.fail(op, skip=skip, count=count)
            books(p, v, live)
            tails_intact()
        if p.stats()["compactions"]:
            outcome = "compacted"
    finally:
        _clear_faults(v)
        v.lib.fake_fail(_COPY[backend], 0, 0, 0)
        try:
            p.close()
        except PoolError:
            pass
    assert v.lib.fake_used() == 0 and v.lib.fake_live() == 0
    return outcome


def test_replay_command_compacts_the_policies_that_can(tmp_path, capsys) -> None:
    """`npu-pool replay --compact`: the npu_pool and planned rows with compaction, the others as
    they are; said plainly where it cannot apply."""
    from npu_pool.cli import main
    from npu_pool.trace.format import OP_ALLOC, OP_FREE, Trace

    t = Trace()
    ids = iter(range(1000))
    live = [next(ids) for _ in range(10)]
    for i in live:  # the pinned pattern above, as a trace: 25 MiB blocks, every other one freed, then 75 MiB
        t.append(OP_ALLOC, id=i, size=BLOCK)
    for i in live[::2]:
        t.append(OP_FREE, id=i, size=BLOCK)
    big = next(ids)
    t.append(OP_ALLOC, id=big, size=3 * BLOCK)
    for i in [*live[1::2], big]:
        t.append(OP_FREE, id=i, size=BLOCK if i != big else 3 * BLOCK)
    t.meta["n_ids"] = big + 1
    path, out = tmp_path / "pinned.npt", tmp_path / "r.json"
    t.save(path)
    caps = {}
    for compact in (False, True):
        assert main(["replay", str(path), "--policy", "torch,npu_pool", "--json", str(out)]
                    + (["--compact"] if compact else [])) == 0
        rows = {r["policy"]: r for r in json.loads(out.read_text())}
        caps[compact] = (rows["torch"]["min_capacity_bytes"], rows["npu_pool"]["min_capacity_bytes"])
    assert caps[True][0] == caps[False][0]  # the torch model as it was
    assert caps[True][1] < caps[False][1]  # compaction serves the 75 MiB where pinned pages refused it
    capsys.readouterr()
    assert main(["replay", str(path), "--policy", "torch", "--compact"]) == 2
    assert "--compact applies to the npu_pool and planned policies" in capsys.readouterr().err
    assert main(["replay", str(path), "--validate", "--compact"]) == 2  # (--live --compact: tests/test_live_replay.py)
    assert "--validate takes no --compact" in capsys.readouterr().err


def test_a_pool_whose_bytes_were_lost_says_so_at_check(fakes: dict) -> None:
    """After a compaction lost live bytes, check() gives the lost state's message (not a broken
    invariant: live blocks on unmapped pages are what 'lost' means), and a debug build (NP_DEBUG),
    which checks every invariant as each call returns, reports the loss instead of aborting."""
    v = _vendor(fakes, "cuda")
    p = v.pool(compact=True)
    _pinned(p, fill=True)
    v.fail("create", count=1000)
    with pytest.raises(PoolError, match="could not put its .* of live bytes back"):
        p.malloc(3 * BLOCK)
    with pytest.raises(PoolError, match="a compaction could not put live tensors' bytes back"):
        p.check()
    v.fail("create", count=0)
    p.close()
    assert v.lib.fake_used() == 0 and v.lib.fake_live() == 0


@pytest.mark.parametrize("pinned, asks", [("A", None), (None, "A"), ("A", "B")])
def test_compaction_returns_the_free_pages_other_arenas_pin(pinned: str | None, asks: str | None) -> None:
    """With tagged regions every arena counts against the one cap: a request that fails in its own
    arena has the other arenas' chunks compacted too (their pinned free pages), as empty_cache
    returns their wholly free chunks, before it fails."""
    with Pool("npu_pool", capacity=256 * MiB, host_backed=True, compact=True) as p:
        def alloc(tag: str | None, n: int) -> int:
            if tag is None:
                return p.malloc(n)
            with p.region(tag):
                return p.malloc(n)
        with p.region("B"):
            pass
        live = _pinned(p, fill=True, alloc=lambda n: alloc(pinned, n))
        big = alloc(asks, 3 * BLOCK)
        ctypes.memset(big, 0x7F, 3 * BLOCK)
        assert _intact(live) and p.stats()["compactions"] > 0
        p.check()


def test_a_resume_has_the_other_arenas_compacted_before_it_fails() -> None:
    with Pool("npu_pool", capacity=256 * MiB, host_backed=True, compact=True) as p:
        with p.region("A"):
            a = p.malloc(3 * BLOCK)
        ctypes.memset(a, 0x5A, 3 * BLOCK)
        p.pause("A", backup=True)
        live = _pinned(p, fill=True)
        p.resume("A")
        assert ctypes.string_at(a, 3 * BLOCK) == b"\x5a" * (3 * BLOCK)
        assert _intact(live) and p.stats()["compactions"] > 0
        p.check()


@pytest.mark.parametrize("block,where,inside", [(5 * MiB, None, False), (5 * MiB, "B", False), (5 * MiB, "B", True),
                                               (MiB, None, False)])
def test_a_resume_s_out_of_memory_names_what_compacting_the_other_arenas_gives_back(block: int, where: str | None,
                                                                                    inside: bool) -> None:
    """A resume that fails for the free pages the other arenas' live blocks keep mapped (the
    untagged arena's or region B's; the resume called inside B or outside every region) is
    fragmentation (its blocks go back at fixed addresses: any room under the cap serves them), not a
    shortage: the message, its oom event and npu_pool.oom.explain name what a compaction would give
    back, which compact() then gives back, where it is not 0 (5 MiB blocks: enough for the resume
    after it); a live block on every page (1 MiB blocks) names none. explain() says it is a resume's,
    names the arena whose free memory it lacked, and no planned policy (which has no regions)."""
    import re

    from npu_pool import oom

    with Pool("npu_pool", capacity=256 * MiB, host_backed=True) as p:
        with p.region("A"):
            p.malloc(64 * MiB)
        p.pause("A", backup=True)
        with p.region("B"):
            pass

        ptrs: list[int] = []
        with pytest.raises(OutOfMemoryError):  # (the region's blocks, or the untagged arena's, up to the cap)
            with contextlib.ExitStack() as region:
                if where is not None:
                    region.enter_context(p.region(where))
                while True:
                    ptrs.append(p.malloc(block))
        for x in ptrs[::2]:
            p.free(x)
        with pytest.raises(OutOfMemoryError, match="resume of tag 'A' failed") as e:
            if inside:
                with p.region("B"):
                    p.resume("A")
            else:
                p.resume("A")
        said = re.search(r"compaction would give back ([0-9.]+) MiB", str(e.value))
        event = [e for e in p.history() if e["kind"] == "oom"][-1]
        x = oom.explain(p)
        advice = [s for s in x.suggestions if "compact" in s]
        assert x.kind == "fragmentation" and x.resume and len(advice) == bool(said) == (block == 5 * MiB)
        assert not any("planned" in s for s in x.suggestions) and "the resume maps its blocks again" in x.summary()
        assert any(f"({where or 'untagged'}: " in s for s in x.suggestions), x.suggestions
        returned = p.compact()
        assert event["compactable"] == returned and (not said or float(said.group(1)) * MiB == returned)
        if said:
            assert f"give back the {said.group(1)} MiB of " in advice[0]
            p.resume("A")
        else:
            assert returned == 0
        p.check()


def test_a_region_s_out_of_memory_names_what_compacting_every_arena_gives_back() -> None:
    """A request in region B that fails for the free pages the untagged arena's live blocks keep
    mapped: the figure its message names is what compact() gives back, every arena's (B's own holds
    none), as a resume's is."""
    import re

    with Pool("npu_pool", capacity=256 * MiB, host_backed=True) as p:
        for x in _fill(p, lambda: 5 * MiB)[::2]:
            p.free(x)
        with pytest.raises(OutOfMemoryError) as e:
            with p.region("B"):
                p.malloc(100 * MiB)
        said = re.search(r"compaction would give back ([0-9.]+) MiB", str(e.value))
        assert said, str(e.value)
        returned = p.compact()
        assert returned > 0 and float(said.group(1)) * MiB == returned
        assert [e["compactable"] for e in p.history() if e["kind"] == "oom"][-1] == returned
        p.check()


def test_compaction_brings_a_pool_held_past_a_lowered_cap_back_under_it() -> None:
    """A fraction lowered below what is mapped: each chunk's live pages map again within what the
    device just took back (before, the cap refused them, every compaction was undone after its
    copies and a request that fits once compacted failed)."""
    with Pool("npu_pool", capacity=256 * MiB, host_backed=True, compact=True) as p:
        live = _pinned(p, fill=True)
        p.set_fraction(0.75)  # 192 MiB: 250 mapped, 125 live
        big = p.malloc(40 * MiB)
        ctypes.memset(big, 0x7F, 40 * MiB)
        assert _intact(live) and p.stats()["compactions"] > 0
        assert p.stats()["total"]["reserved"]["current"] <= 192 * MiB
        p.check()


def test_a_compaction_frees_the_request_s_whole_pages_first_time() -> None:
    """A cap that is not a multiple of the page: the first round stops once the cap has room for
    the request's pages, not its bytes (it stopped a page short, and the second round compacted
    every chunk)."""
    with Pool("npu_pool", capacity=257 * MiB, host_backed=True, compact=True) as p:
        ptrs = _fill(p, lambda: 4 * MiB)
        for x in ptrs[::2]:
            p.free(x)
        p.empty_cache()
        p.malloc(13 * MiB)
        assert p.stats()["compactions"] <= 2, p.stats()["compactions"]


# -- compact(): now, at a moment the caller chooses ---------------------------------------------

def _pages(live: dict[int, int], page: int = 2 * MiB) -> int:
    """The bytes of the pages the live blocks touch: what a pool compacted to the bone maps."""
    return page * len({q for x in live for q in range(x // page, (x + BLOCK - 1) // page + 1)})


@pytest.mark.parametrize("backend", ["acl", "cuda"])
def test_compact_returns_what_live_tensors_pin_with_the_setting_off(fakes: dict, backend: str) -> None:
    """empty_cache cannot return the free pages of a chunk a live block holds; compact() can: the
    pool then maps the pages its live blocks touch and no more, the bytes where they were, the
    books and the calls matching the device's; its history has a compact event per chunk replaced."""
    v = _vendor(fakes, backend)
    with v.pool() as p:
        live = _pinned(p, fill=True)
        before = p.stats()["total"]["reserved"]["current"]
        with pytest.raises(OutOfMemoryError):
            p.malloc(3 * BLOCK)
        assert p.stats()["total"]["reserved"]["current"] == before  # the retry's empty_cache gave nothing back
        returned = p.compact()
        st = p.stats()
        assert returned == before - st["total"]["reserved"]["current"] > 0
        assert st["total"]["reserved"]["current"] == _pages(live)
        assert _intact(live) and st["compactions"] > 0 and st["compacted"] > 0
        # the history says so: a compact event per chunk replaced, after that chunk's unmap, the bytes moved
        h = p.history()
        moved = [(i, e) for i, e in enumerate(h) if e["kind"] == "compact"]
        assert len(moved) == st["compactions"] and sum(e["size"] for _, e in moved) == st["compacted"]
        assert all([u for u in h[:i] if u["kind"] == "segment_unmap"][-1]["addr"] == e["addr"] for i, e in moved)
        _books_match(p, v)
        assert {k: st["calls"][k] for k in KINDS} == {k: v.lib.fake_calls(vocab.CALL_VENDOR[backend][k].encode())
                                                     for k in KINDS}
        assert p.compact() == 0 and p.stats()["compactions"] == st["compactions"]  # nothing left to move
        ctypes.memset(p.malloc(3 * BLOCK), 0x7F, 3 * BLOCK)
        assert _intact(live)
        _books_match(p, v)
    assert v.lib.fake_used() == 0


@pytest.mark.parametrize("op", ["copy", "unmap", "create", "release"])
def test_a_vendor_call_failing_in_compact_loses_no_byte(fakes: dict, op: str) -> None:
    """compact() is the out-of-memory's compaction called directly: a refusal half-way leaves that
    chunk as it was (or asks again) and says so; the bytes and the books hold."""
    v = _vendor(fakes, "cuda")
    with v.pool() as p:
        live = _pinned(p, fill=True)
        if op == "copy":
            v.lib.fake_fail(b"cudaMemcpy", 0, 1, 999)
        else:
            v.fail(op, count=1)
        if op == "create":  # asked again: the device took the whole chunk back a moment before
            p.compact()
        else:  # that chunk stays as it was, the others are compacted, and the refusal is said
            with pytest.raises(BackendError):
                p.compact()
        assert _intact(live)
        _books_match(p, v)
        _clear_faults(v)
        p.compact()
        assert p.stats()["total"]["reserved"]["current"] == _pages(live) and _intact(live)
        _books_match(p, v)
    assert v.lib.fake_used() == 0


def test_memory_the_device_keeps_at_compact_s_empty_cache_stops_no_compaction(fakes: dict) -> None:
    """The empty_cache that compact() starts with returns a wholly free chunk the device refuses to
    take back: that chunk is held (counted, retried later), the chunks live blocks pin are compacted
    all the same, and the refusal is said."""
    v = _vendor(fakes, "cuda")
    with v.pool() as p:
        live = _pinned(p, fill=True)
        p.free(p.malloc(40 * MiB))  # grows the arena: a chunk of its own, wholly free again
        v.fail("release", count=1)
        with pytest.raises(BackendError):
            p.compact()
        st = p.stats()
        assert st["compactions"] > 0 and st["unreleased"] > 0 and _intact(live)
        assert st["total"]["reserved"]["current"] == _pages(live) + st["unreleased"]
        _books_match(p, v)
        _clear_faults(v)
        p.empty_cache()  # the held chunk goes back now
        assert p.stats()["total"]["reserved"]["current"] == _pages(live)
        _books_match(p, v)


def test_compact_leaves_paused_regions_and_compacts_the_others() -> None:
    """A paused tag's memory is off the device already and stays so; the main arena's and an
    unpaused tag's chunks are compacted, and the paused tag resumes with its bytes."""
    with Pool("npu_pool", capacity=512 * MiB, host_backed=True) as p:
        with p.region("A"):
            a = p.malloc(3 * BLOCK)
        ctypes.memset(a, 0x5A, 3 * BLOCK)
        p.pause("A", backup=True)

        def in_b(n: int) -> int:
            with p.region("B"):
                return p.malloc(n)
        live = _pinned(p, fill=True)
        live_b = _pinned(p, fill=True, alloc=in_b)
        assert p.compact() > 0
        tags = p.tags()
        assert tags["A"]["is_paused"] and tags["A"]["mapped"] == 0
        assert tags["B"]["mapped"] == _pages(live_b)
        assert p.stats()["total"]["reserved"]["current"] == _pages(live) + _pages(live_b)
        assert _intact(live) and _intact(live_b)
        p.resume("A")
        assert ctypes.string_at(a, 3 * BLOCK) == b"\x5a" * (3 * BLOCK)
        p.check()


def test_compact_under_the_planned_policy_compacts_its_fallback_arena() -> None:
    with Pool("planned", capacity=256 * MiB, host_backed=True) as p:  # no plan: every request is the fallback's
        live = _pinned(p, fill=True)
        assert p.compact() > 0 and _intact(live)
        assert p.stats()["total"]["reserved"]["current"] == _pages(live)
        p.check()


def test_compact_says_where_it_cannot_apply() -> None:
    for policy in ("torch", "expandable"):
        with Pool(policy, capacity=64 * MiB) as p:
            p.free(p.malloc(MiB))
            with pytest.raises(PoolError, match=f"policy {policy} does not compact"):
                p.compact()
            p.check()
    with Pool("npu_pool", capacity=64 * MiB, vmm=False) as p:
        with pytest.raises(PoolError, match="needs the virtual-memory API"):
            p.compact()
    p = Pool("npu_pool", capacity=64 * MiB)
    p.close()
    with pytest.raises(PoolError, match="closed pool"):
        p.compact()


def _churn_while_compacting(seed: int) -> int:
    """Three threads allocating and freeing while a fourth calls compact() in a loop; every
    invariant and the books checked after. Returns the chunks compacted."""
    with Pool("npu_pool", capacity=256 * MiB) as p:
        errors: list[BaseException] = []
        done = threading.Event()

        def compactor() -> None:
            try:
                while not done.is_set():
                    p.compact()
            except BaseException as ex:  # noqa: BLE001 - reported below
                errors.append(ex)

        threads = [threading.Thread(target=_churn, args=(p, seed + s, 12, errors)) for s in range(3)]
        c = threading.Thread(target=compactor)
        c.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        done.set()
        c.join()
        assert not errors, errors
        p.check()
        st = p.stats()
        assert st["total"]["allocated"]["current"] == 0
        p.compact()
        assert p.stats()["total"]["reserved"]["current"] == 0
        return st["compactions"]


def test_threads_allocating_while_another_compacts_keep_the_books() -> None:
    """compact() takes the pool's lock as a request does: three threads allocating and freeing (and
    touching no memory: the contract) while a fourth compacts leave every invariant whole. Whether
    a compaction finds pages to give back while the others run is up to the scheduler (on a loaded
    machine the churn can end first): the run is repeated, with new seeds, until one did."""
    assert any(_churn_while_compacting(seed) > 0 for seed in range(0, 50, 10))


@pytest.mark.parametrize("by", ["a request", "compact()"])
def test_a_snapshot_s_device_trace_keeps_the_tensors_a_compaction_moved(by: str) -> None:
    """A compaction unmaps a chunk under live tensors for a moment: the memory snapshot's device
    trace shows each one leaving with it and coming back once none of its bytes is unmapped; a
    tensor that reaches into a chunk left as it was came back at no map, and vanished from the
    trace (3 of the 6 live tensors here before)."""
    from npu_pool.snapshot import pool_snapshot

    with Pool("npu_pool", capacity=256 * MiB, host_backed=True, compact=by == "a request") as p:
        _pinned(p, fill=False)
        big = p.malloc(3 * BLOCK) if by == "a request" else None
        if big is None:
            assert p.compact() > 0
        on_device: set[int] = set()
        for e in pool_snapshot({0: p})["device_traces"][0]:
            if e["action"] == "alloc":
                assert e["addr"] not in on_device
                on_device.add(e["addr"])
            elif e["action"] == "free_completed":
                on_device.remove(e["addr"])
        assert p.stats()["compactions"] > 0
        assert on_device == {b["addr"] for b in p.blocks() if b["allocated"]}


@pytest.mark.parametrize("backend", ["acl", "cuda"])
def test_a_device_out_of_memory_in_compact_leaves_that_chunk_as_it_was(fakes: dict, backend: str) -> None:
    """The device took a chunk back and then refuses, out of memory, the chunks over its live pages
    (another process took the memory in between): the chunk maps again as it was, the others are
    compacted, and compact() raises OutOfMemoryError (the vendor's out-of-memory code, not a
    BackendError: docs/api.md, Compaction)."""
    v = _vendor(fakes, backend)
    with v.pool() as p:
        live = _pinned(p, fill=True)
        v.fail("create", count=2, code=207001 if backend == "acl" else 2)  # both tries of map_kept
        with pytest.raises(OutOfMemoryError) as e:
            p.compact()
        assert not isinstance(e.value, BackendError)
        st = p.stats()
        assert st["compactions"] > 0 and st["total"]["reserved"]["current"] > _pages(live) and _intact(live)
        _books_match(p, v)
        _clear_faults(v)
        assert p.compact() > 0 and p.stats()["total"]["reserved"]["current"] == _pages(live) and _intact(live)


@pytest.mark.parametrize("seed", range(6))
def test_a_snapshot_s_device_trace_shows_on_the_device_what_is_mapped_under_it(seed: int) -> None:
    """Random requests, frees, pauses, resumes, compactions (at a request and by compact()) and
    empty_caches: replaying the snapshot's device trace leaves on the device exactly the allocated
    blocks whose every byte is mapped (a paused tag's are not), whatever chunks they span."""
    from npu_pool.snapshot import pool_snapshot

    rng = random.Random(seed)
    with Pool("npu_pool", capacity=160 * MiB, compact=rng.random() < 0.5) as p:
        p.set_history(1 << 20)
        mine: dict[str | None, list[int]] = {None: [], "A": [], "B": []}
        for _ in range(300):
            tag = rng.choice([None, None, "A", "B"])
            paused = {t for t, v in p.tags().items() if v["is_paused"]}
            r = rng.random()
            if r < 0.5 and tag not in paused:
                try:
                    if tag is None:
                        mine[tag].append(p.malloc(rng.choice([300_000, 3 * MiB + 5, 9 * MiB, 25 * MiB])))
                    else:
                        with p.region(tag):
                            mine[tag].append(p.malloc(rng.choice([300_000, 3 * MiB + 5, 9 * MiB, 25 * MiB])))
                except OutOfMemoryError:
                    pass
            elif r < 0.8 and mine[tag]:
                p.free(mine[tag].pop(rng.randrange(len(mine[tag]))))
            elif r < 0.86 and tag is not None:
                try:
                    p.resume(tag) if tag in paused else p.pause(tag)
                except PoolError:  # (a tag with nothing allocated yet, or no room to resume)
                    pass
            elif r < 0.93:
                p.compact()
            else:
                p.empty_cache()
        ranges = sorted(p.mapped_ranges())

        def mapped(lo: int, hi: int) -> bool:
            for start, size in ranges:
                if start <= lo < start + size:
                    lo = start + size
                if lo >= hi:
                    return True
            return False

        on_device: set[int] = set()
        for e in pool_snapshot({0: p})["device_traces"][0]:
            if e["action"] == "alloc":
                on_device.add(e["addr"])
            elif e["action"] == "free_completed":
                on_device.discard(e["addr"])
        want = {b["addr"] for b in p.blocks() if b["allocated"] and mapped(b["addr"], b["addr"] + b["size"])}
        assert on_device == want
        p.check()


def test_the_out_of_memory_message_s_compaction_figure_is_what_compact_gives_back() -> None:
    """Random fills freed by half, then a request the pool cannot serve: where the message says what
    a compaction would give back (fragmentation, compaction off), compact() after an empty_cache
    gives back exactly that; a fragmentation failure that names no figure is one compaction could
    not help. npu_pool.oom.explain advises compaction, with the same figure, exactly where the
    message names one (its figure: the failure's oom event, np_event_info.compactable)."""
    import re

    from npu_pool import oom

    units = {"bytes": 1, "KiB": 1 << 10, "MiB": MiB, "GiB": 1 << 30}
    named = unhelped = 0
    for seed in range(60):
        rng = random.Random(seed)
        with Pool("npu_pool", capacity=rng.choice([128, 256, 384]) * MiB, rules=rng.choice(["npu", "cuda"])) as p:
            ptrs = _fill(p, lambda: rng.choice([300_000, 3 * MiB + 5, 9 * MiB, 25 * MiB, 40 * MiB]))
            rng.shuffle(ptrs)
            for x in ptrs[: len(ptrs) // 2]:
                p.free(x)
            try:
                p.free(p.malloc(int(p.stats()["limit"] * rng.choice([0.1, 0.2, 0.3]))))
                continue
            except OutOfMemoryError as e:
                said = re.search(r"compaction would give back ([0-9.]+) (bytes|KiB|MiB|GiB)", str(e))
                fragmentation = "; fragmentation:" in str(e)
            # npu_pool.oom.explain (OOM snapshots, the CLI) advises it where the message does, with its figure
            advice = [s for s in oom.explain(p).suggestions if "compact" in s]
            assert len(advice) == bool(said) and (not said or f"give back the {said.group(1)} {said.group(2)} of "
                                                  in advice[0]), (seed, advice, said)
            p.empty_cache()
            got = p.compact()
            if said:
                named += 1
                assert abs(float(said.group(1)) * units[said.group(2)] - got) < 0.01 * MiB, (seed, said.group(0), got)
            elif fragmentation:
                unhelped += 1
                assert got == 0, seed
    for rules in ("npu", "cuda"):  # one a compaction cannot help: a live block on every page, the rest free
        with Pool("npu_pool", capacity=64 * MiB, rules=rules) as p:
            ptrs = _fill(p, lambda: MiB)
            for x in ptrs[::2]:
                p.free(x)
            with pytest.raises(OutOfMemoryError, match="; fragmentation:") as e:
                p.malloc(3 * MiB)
            assert "compaction" not in str(e.value) and not any("compact" in s for s in oom.explain(p).suggestions)
            unhelped += 1
            p.empty_cache()
            assert p.compact() == 0
    assert named >= 3 and unhelped >= 2, (named, unhelped)


def _unmaps_under_live_seconds(first: int, live: int = 4000, unmaps: int = 2000) -> float:
    """Seconds for the device trace of a history: an allocation of ``first`` bytes freed at once,
    ``live`` 64 KiB blocks allocated side by side, then ``unmaps`` chunks of 2 MiB above them
    unmapped and mapped again (best of three)."""
    import time

    from npu_pool.snapshot import device_trace

    def ev(kind: str, addr: int, size: int) -> dict:
        return {"kind": kind, "addr": addr, "size": size, "stream": 0, "time": 0, "pool": 0}

    base = 1 << 40
    events = [ev("alloc", base, first), ev("free", base, first)]
    events += [ev("alloc", base + i * (64 << 10), 64 << 10) for i in range(live)]
    top = base + live * (64 << 10)
    for i in range(unmaps):
        events += [ev("segment_unmap", top + i * 2 * MiB, 2 * MiB), ev("segment_map", top + i * 2 * MiB, 2 * MiB)]
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        trace = device_trace(events)
        best = min(best, time.perf_counter() - start)
    assert sum(e["action"] == "alloc" for e in trace) == live + 1  # (the unmaps hold none of them)
    return best


def test_a_snapshot_s_device_trace_does_not_look_back_as_far_as_its_largest_tensor() -> None:
    """An unmap looks for the tensors that reach into its range: bucketed by first byte, those
    starting as far below it as the largest tensor the history held, so that one 4 GiB tensor,
    long freed, made every unmap walk every live tensor of the 4 GiB under it (a history of 20,000
    live tensors and 7,000 unmaps: 5 s against 0.1 s). One large tensor costs no more time."""
    small = _unmaps_under_live_seconds(64 << 10)
    large = _unmaps_under_live_seconds(4 << 30)
    assert large < 3 * small, f"{large / small:.1f}x the time with one 4 GiB tensor in the history"


def test_the_oom_advice_names_no_compaction_a_backend_refuses(builds: dict) -> None:  # noqa: F811
    """npu_pool.oom.explain advised npu_pool.compact() and NPU_POOL_COMPACT=1 wherever the pool maps
    page by page and compaction is off, also on a backend that cannot copy device memory (the plain
    fake ACL has no aclrtMemcpy), where compact() refuses and the out-of-memory message itself names
    no compaction. There it names none; where compact() works it still does."""
    from npu_pool import oom

    for path, copies in ((builds[("acl", "full")], False), (builds[("cuda", "full")], True)):
        v = Vendor("acl" if not copies else "cuda", path, ctypes.CDLL(path))
        v.lib.fake_set_capacity(64 * MiB)
        with v.pool() as p:
            ptrs = _fill(p, lambda: 3 * MiB)
            for x in ptrs[::2]:
                p.free(x)
            with pytest.raises(OutOfMemoryError) as e:
                p.malloc(12 * MiB)
            x = oom.explain(p)
            assert x.kind == "fragmentation" and p.stats()["vmm"] and not p.stats()["compaction"]
            advised = any("compact" in s for s in x.suggestions)
            assert advised == copies == ("compaction would give back" in str(e.value)), (path, x.suggestions)
            if not copies:
                with pytest.raises(PoolError, match="cannot copy device memory"):
                    p.compact()
