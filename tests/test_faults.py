"""Vendor faults: random allocation sequences on the fake ACL and CUDA runtimes while their calls
fail at random (malloc, free, physical create and release, map, unmap, reserve, access). After
every step the pool's books must match the device -- reserved bytes equal what the fake device
has handed out -- no live block may lie on an unmapped page (its bytes are written and read
back), and every invariant holds. Memory the device refused to take back is retried until it
goes, and nothing is left behind at close."""
from __future__ import annotations

import ctypes

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from npu_pool.pool import BackendError, OutOfMemoryError, Pool, PoolError
from test_backends import MiB, NAMES, Vendor, _vendor, builds  # noqa: F401 (builds: the fixture)

FAULTS = ("malloc", "free", "create", "release", "map", "unmap", "reserve", "release_range")

steps = st.lists(st.one_of(
    st.tuples(st.just("alloc"), st.sampled_from([1000, 300_000, 3 * MiB + 5, 9 * MiB, 17 * MiB]),
              st.sampled_from(["long", "short"])),
    st.tuples(st.just("free"), st.integers(0, 1000)),
    st.tuples(st.just("empty_cache")),
    st.tuples(st.just("fault"), st.sampled_from(FAULTS), st.integers(0, 3), st.integers(1, 2)),
), min_size=5, max_size=60)


def _books_match(p: Pool, v: Vendor, live: dict[int, tuple[int, int]]) -> None:
    p.check()
    st_ = p.stats()
    assert st_["total"]["reserved"]["current"] == v.lib.fake_used(), "the pool's books disagree with the device"
    h = p.history()
    if h and h[0]["seq"] == 0:  # the whole history: it adds up to the reserved bytes (timelines read it so)
        grow = sum(e["size"] for e in h if e["kind"] in ("segment_alloc", "segment_map", "hold"))
        shrink = sum(e["size"] for e in h if e["kind"] in ("segment_free", "segment_unmap", "unhold"))
        assert grow - shrink == st_["total"]["reserved"]["current"], "the history disagrees with the books"
    for b in p.blocks():
        if b["allocated"]:
            assert b["mapped"], f"live block {b['addr']:#x} lies on an unmapped page"
    for ptr, (size, byte) in live.items():  # on an unmapped page this would fault
        assert ctypes.string_at(ptr, min(size, 64)) == bytes([byte]) * min(size, 64)


def _written(live: dict[int, tuple[int, int]], ptr: int, size: int) -> None:
    """Write a byte over the new block's start and note it in `live` (read back by _books_match)."""
    byte = 1 + len(live) % 250
    ctypes.memset(ptr, byte, min(size, 64))
    live[ptr] = (size, byte)


def _free_one(p: Pool, live: dict[int, tuple[int, int]], k: int) -> None:
    """Free the live block k-th by address (modulo their number)."""
    ptr = sorted(live)[k % len(live)]
    p.free(ptr)
    del live[ptr]


def _clear_faults(v: Vendor) -> None:
    for op in FAULTS + ("access",):
        if op in NAMES[v.backend]:
            v.lib.fake_fail(v.name(op).encode(), 0, 0, 0)


@pytest.mark.parametrize("backend", ["acl", "cuda"])
@pytest.mark.parametrize("policy", ["npu_pool", "torch", "expandable", "planned"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(seq=steps)
def test_books_match_the_device_under_random_vendor_faults(builds: dict, backend: str, policy: str, seq: list) -> None:
    v = _vendor(builds, backend, capacity=192 * MiB)
    p = v.pool(policy)
    live: dict[int, tuple[int, int]] = {}
    try:
        for step in seq:
            if step[0] == "alloc":
                try:
                    ptr = p.malloc(step[1], lifetime=step[2])
                except (OutOfMemoryError, BackendError):
                    pass  # a failure the vendor injected, or a full device: the pool stays consistent
                else:
                    _written(live, ptr, step[1])
            elif step[0] == "free" and live:
                _free_one(p, live, step[1])  # a free never fails: the block goes back to the pool
            elif step[0] == "empty_cache":
                try:
                    p.empty_cache()
                except BackendError as e:
                    assert "still holds" in str(e) or NAMES[backend]["internal_name"] in str(e)
            elif step[0] == "fault":
                _, op, skip, count = step
                v.fail(op, skip=skip, count=count)
            _books_match(p, v, live)
        _clear_faults(v)
        for ptr in list(live):
            p.free(ptr)
        p.empty_cache()  # with the faults gone, what the device refused before goes back now
        _books_match(p, v, {})
        assert p.stats()["unreleased"] == 0
        if policy != "torch":  # the torch model keeps nothing cached after empty_cache either
            assert v.lib.fake_mapped() == 0
    finally:
        _clear_faults(v)
        try:
            p.close()
        except PoolError:
            pass
    assert v.lib.fake_used() == 0 and v.lib.fake_live() == 0


@pytest.mark.parametrize("backend", ["acl", "cuda"])
def test_a_failed_free_is_held_counted_and_retried(builds: dict, backend: str) -> None:
    v = _vendor(builds, backend)
    p = v.pool("torch")
    ptr = p.malloc(17 * MiB)  # one 18 MiB segment (17 MiB + the vendor's padding, rounded to 2 MiB)
    p.free(ptr)
    segment = p.stats()["total"]["reserved"]["current"]
    v.fail("free")
    with pytest.raises(BackendError, match="still holds") as e:
        p.empty_cache()
    assert NAMES[backend]["free"] in str(e.value)
    st_ = p.stats()
    assert st_["unreleased"] == segment == st_["total"]["reserved"]["current"] == v.lib.fake_used()
    p.check()
    p.empty_cache()  # retried: this time it goes
    assert p.stats()["unreleased"] == 0 == p.stats()["total"]["reserved"]["current"] == v.lib.fake_used()
    p.close()


@pytest.mark.parametrize("backend", ["acl", "cuda"])
def test_a_failed_page_release_is_held_and_close_says_what_is_lost(builds: dict, backend: str) -> None:
    v = _vendor(builds, backend)
    p = v.pool("npu_pool")
    p.free(p.malloc(4 * MiB - v.pad))  # one chunk of 20 MiB (the arena's growth granule)
    v.fail("release", count=1000)  # the physical chunk never goes back
    with pytest.raises(BackendError, match="still holds"):
        p.empty_cache()
    st_ = p.stats()
    assert v.lib.fake_mapped() == 0 and st_["unreleased"] == 20 * MiB == st_["total"]["reserved"]["current"]
    assert v.lib.fake_used() == 20 * MiB  # held, not forgotten
    assert st_["releasable"] == 20 * MiB  # (empty_cache retries it: what it returns once the device takes it)
    with pytest.raises(BackendError, match="still holds 20.00 MiB"):
        p.close()  # retried once more at close, then reported
    _clear_faults(v)
    p = v.pool("npu_pool")
    p.free(p.malloc(4 * MiB - v.pad))
    v.fail("release")  # refused once: the next empty_cache returns it, as releasable said
    with pytest.raises(BackendError, match="still holds"):
        p.empty_cache()
    st_ = p.stats()
    p.empty_cache()
    assert st_["releasable"] == 20 * MiB == st_["total"]["reserved"]["current"] - p.stats()["total"]["reserved"]["current"]
    p.close()


@pytest.mark.parametrize("backend", ["acl", "cuda"])
@pytest.mark.parametrize("policy", ["npu_pool", "planned"])
def test_a_refused_release_under_the_cap_never_takes_the_pool_past_it(builds: dict, backend: str, policy: str) -> None:
    """Under cap pressure a free chunk of another stream is unmapped and its physical memory given
    back to make room; when the device refused to take it back (held, still reserved) the new chunk
    was mapped all the same: 36 MiB reserved under a 32 MiB cap (a review fuzzing the core, 2026-11-27)."""
    v = _vendor(builds, backend, capacity=64 * MiB)
    p = v.pool(policy, fraction=0.5)
    p.free(p.malloc(25 * MiB - v.pad, stream=1))
    v.fail("release", count=1000)
    try:
        p.malloc(8 * MiB - v.pad, stream=0)
    except OutOfMemoryError as e:
        assert "refused to take back" in str(e) or "still holds" in str(e), e
    st_ = p.stats()
    assert st_["total"]["reserved"]["current"] <= st_["limit"] == 32 * MiB, st_["total"]["reserved"]
    assert v.lib.fake_used() == st_["total"]["reserved"]["current"]
    p.check()
    _clear_faults(v)
    p.close()


@pytest.mark.parametrize("backend", ["acl", "cuda"])
def test_a_failed_unmap_then_remap_never_hands_out_a_lost_page(builds: dict, backend: str) -> None:
    """Unmap fails on a chunk, and the mapping of a new chunk fails too: a chunk whose state is
    unknown to nobody any more (the page table says what is mapped) is never handed out unmapped,
    and the caller hears about both failures."""
    v = _vendor(builds, backend)
    p = v.pool("npu_pool")
    keep = p.malloc(MiB)  # the first chunk [0, 20 MiB) holds keep
    a = p.malloc(20 * MiB)  # the next growths are chunks that free up whole
    c = p.malloc(30 * MiB)
    d = p.malloc(80 * MiB)
    p.free(a)
    p.free(c)
    p.free(d)
    v.fail("unmap", skip=1)  # the first free chunk goes, the next refuses
    with pytest.raises(BackendError):
        p.empty_cache()
    v.fail("map", skip=0, count=1)
    with pytest.raises(BackendError):
        p.malloc(60 * MiB)  # more than the mapped free memory: a new chunk
    _books_match(p, v, {})
    b = p.malloc(60 * MiB)  # now it maps what it needs
    ctypes.memset(b, 0x42, 60 * MiB)
    assert ctypes.string_at(b + 60 * MiB - 16, 16) == b"\x42" * 16
    _books_match(p, v, {})
    p.free(b)
    p.free(keep)
    p.empty_cache()
    assert v.lib.fake_used() == 0
    p.close()


@pytest.mark.parametrize("backend", ["acl", "cuda"])
def test_a_chunk_whose_unmap_failed_is_unmapped_before_its_place_is_mapped_again(builds: dict, backend: str) -> None:
    """A chunk the device refused to unmap at a trim of the expandable model stays mapped, held;
    its pages are unmapped in the page table, so the next growth maps there. The held chunk is
    unmapped first (before: the map was refused as an invalid value, request after request, until
    an empty_cache)."""
    v = _vendor(builds, backend)
    p = v.pool("expandable")
    a = p.malloc(40 * MiB)
    keep = p.malloc(40 * MiB)  # keeps the segment: a's place is mapped again, not a new segment
    p.free(a)
    v.fail("unmap", skip=0, count=1)
    with pytest.raises(BackendError):
        p.empty_cache()
    assert p.stats()["unreleased"] > 0
    b = p.malloc(40 * MiB)
    assert b == a and p.stats()["unreleased"] == 0
    ctypes.memset(b, 0x42, 40 * MiB)
    _books_match(p, v, {})
    p.free(b)
    v.fail("unmap", skip=0, count=3)  # empty_cache tries it twice; it refuses again when the map needs its place
    with pytest.raises(BackendError):
        p.empty_cache()
    with pytest.raises(BackendError, match="refused to unmap before, and refuses again: ") as info:
        p.malloc(40 * MiB)
    unmap = NAMES[backend]["unmap"]  # the vendor's own reason follows, whole
    assert str(info.value).count("refuses again") == 1 and unmap in str(info.value), str(info.value)
    _books_match(p, v, {})
    c = p.malloc(40 * MiB)  # the device gives in: served there
    assert c == a
    _books_match(p, v, {})
    p.free(c)
    p.free(keep)
    p.empty_cache()
    assert v.lib.fake_used() == 0
    p.close()


full_steps = st.lists(st.one_of(
    st.tuples(st.just("alloc"), st.sampled_from([1000, 300_000, 3 * MiB + 5, 9 * MiB, 17 * MiB, 21 * MiB]),
              st.sampled_from(["long", "short"]), st.sampled_from([1, 2])),
    st.tuples(st.just("free"), st.integers(0, 1000)),
    st.tuples(st.just("busy"), st.sampled_from([1, 2]), st.booleans()),
    st.tuples(st.just("empty_cache")),
), min_size=5, max_size=60)


@pytest.mark.parametrize("backend", ["acl", "cuda"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(seq=full_steps)
def test_when_the_cap_is_the_whole_device_the_device_never_refuses_a_chunk(builds: dict, backend: str,
                                                                          seq: list) -> None:
    """No call fails and the cap is the device's memory (fraction 1): a request the pool cannot
    serve is refused by its own cap, never by the device, so the pool never asks for physical
    memory its books do not allow (a trim's unmapped chunks kept for the growth that follows go
    back before a new chunk is created); through trims, retries and busy streams the books equal
    the device after every step."""
    v = _vendor(builds, backend, capacity=64 * MiB)
    p = v.pool("npu_pool", fraction=1.0)
    live: dict[int, tuple[int, int]] = {}
    try:
        for step in seq:
            if step[0] == "alloc":
                try:
                    ptr = p.malloc(step[1], lifetime=step[2], stream=step[3])
                except OutOfMemoryError as e:
                    assert "cap" in str(e) and v.name("create") not in str(e), str(e)
                else:
                    _written(live, ptr, step[1])
            elif step[0] == "free" and live:
                _free_one(p, live, step[1])
            elif step[0] == "busy":
                v.lib.fake_set_busy(step[1], int(step[2]))
            elif step[0] == "empty_cache":
                p.empty_cache()
            _books_match(p, v, live)
    finally:
        v.lib.fake_set_busy(1, 0)
        v.lib.fake_set_busy(2, 0)
        p.close()
    assert v.lib.fake_used() == 0 and v.lib.fake_live() == 0


@pytest.mark.parametrize("backend", ["acl", "cuda"])
def test_a_free_whose_stream_synchronisation_fails_keeps_the_block(builds: dict, backend: str) -> None:
    """A block used on another stream (record_stream) is reused by the torch model only after the
    device has synchronised; if the device cannot, the free fails and the block stays allocated
    (before: the error was set, the free returned success, and the block could be handed out
    while the other stream might still use it)."""
    v = _vendor(builds, backend)
    p = v.pool("torch")
    a = p.malloc(MiB)
    p.record_stream(a, 7)
    v.fail("sync", skip=0, count=1)
    with pytest.raises(BackendError, match="the block stays allocated"):
        p.free(a)
    assert p.stats()["total"]["allocated"]["current"] == p.block_size(a)
    p.check()
    b = p.malloc(MiB)
    assert b != a  # not handed out again while it may be in use
    p.free(a)  # the device synchronises now
    p.free(b)
    p.check()
    # a caller that drops the pointer after the refusal (torch does): the next empty_cache frees it
    c = p.malloc(MiB)
    p.record_stream(c, 7)
    v.fail("sync", skip=0, count=1)
    with pytest.raises(BackendError, match="freed again by the next empty_cache"):
        p.free(c)
    p.check()
    others = [p.malloc(MiB) for _ in range(4)]  # four more refused the same way
    for x in others:
        p.record_stream(x, 7)
        v.fail("sync", skip=0, count=1)
        with pytest.raises(BackendError):
            p.free(x)
    syncs = v.calls("sync")
    p.empty_cache()
    assert v.calls("sync") - syncs == 1  # one for all five (a review: one more per refused free before)
    assert p.stats()["total"]["allocated"]["current"] == 0 and v.lib.fake_used() == 0
    with pytest.raises(PoolError):
        p.free(c)  # freed: a second free is a double free
    p.check()
    p.close()
