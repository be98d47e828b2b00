"""Property-based checks of every policy against a Python model, plus threads and real memory."""
from __future__ import annotations

import bisect
import ctypes
import random
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from npu_pool import Pool
from npu_pool.pool import OutOfMemoryError

MiB = 1 << 20
POLICIES = ["torch", "npu_pool", "expandable"]

sizes = st.one_of(st.integers(1, 4096), st.integers(1, MiB), st.integers(MiB, 24 * MiB), st.integers(24 * MiB, 96 * MiB))
ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), sizes, st.sampled_from([0, 0, 0, 5]), st.sampled_from(["auto", "long", "short"])),
        st.tuples(st.just("free"), st.integers(0, 1 << 30)),
        st.tuples(st.just("empty_cache")),
        st.tuples(st.just("fraction"), st.sampled_from([0.3, 0.6, 1.0])),
    ),
    max_size=120,
)


class Model:
    """What the stats must say, computed independently of the core."""

    def __init__(self) -> None:
        self.live: dict[int, tuple[int, int]] = {}  # ptr -> (block size, requested)
        self.starts: list[int] = []
        self.allocated = self.requested = self.peak_allocated = self.peak_requested = 0

    def add(self, ptr: int, block: int, requested: int) -> None:
        i = bisect.bisect_left(self.starts, ptr)
        assert ptr % 512 == 0, "misaligned block"
        if i < len(self.starts):
            assert ptr + block <= self.starts[i], "overlaps the next live block"
        if i > 0:
            prev = self.starts[i - 1]
            assert prev + self.live[prev][0] <= ptr, "overlaps the previous live block"
        self.starts.insert(i, ptr)
        self.live[ptr] = (block, requested)
        self.allocated += block
        self.requested += requested
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_requested = max(self.peak_requested, self.requested)

    def remove(self, ptr: int) -> None:
        block, requested = self.live.pop(ptr)
        self.starts.remove(ptr)
        self.allocated -= block
        self.requested -= requested


def run_sequence(pool: Pool, seq, capacity: int, host: bool = False) -> None:
    model = Model()
    bound = capacity  # reserved may not grow past the cap, nor past what it held when the cap was lowered
    patterns: dict[int, int] = {}
    for op in seq:
        if op[0] == "alloc":
            _, size, stream, life = op
            try:
                ptr = pool.malloc(size, stream=stream, lifetime=life)
            except OutOfMemoryError:
                continue
            block = pool.block_size(ptr)
            assert block >= size
            model.add(ptr, block, size)
            if host:
                patterns[ptr] = len(model.starts) % 251 + 1
                ctypes.memset(ptr, patterns[ptr], size)
        elif op[0] == "free" and model.live:
            ptr = model.starts[op[1] % len(model.starts)]
            if host:
                size = model.live[ptr][1]
                assert ctypes.string_at(ptr, size) == bytes([patterns.pop(ptr)]) * size, "block contents were overwritten"
            pool.free(ptr)
            model.remove(ptr)
        elif op[0] == "empty_cache":
            pool.empty_cache()
        elif op[0] == "fraction":
            pool.set_fraction(op[1])
            bound = max(int(op[1] * capacity), pool.stats()["total"]["reserved"]["current"])
        s = pool.stats()["total"]
        assert s["allocated"]["current"] == model.allocated
        assert s["requested"]["current"] == model.requested
        assert s["allocated"]["peak"] == model.peak_allocated
        assert s["requested"]["peak"] == model.peak_requested
        assert s["blocks"]["current"] == len(model.live)
        assert s["allocated"]["current"] <= s["reserved"]["current"] <= bound
    pool.check()
    for ptr in list(model.starts):
        pool.free(ptr)
        model.remove(ptr)
    pool.empty_cache()
    s = pool.stats()["total"]
    assert s["reserved"]["current"] == 0 and s["allocated"]["current"] == 0
    pool.check()


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seq=ops)
def test_random_sequences_match_the_model(policy, seq):
    capacity = 512 * MiB
    with Pool(policy, capacity=capacity) as pool:
        run_sequence(pool, seq, capacity)


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=15, deadline=None)
@given(seq=ops)
def test_host_backed_contents_survive(policy, seq):
    """With real memory behind the device, a pattern written into each block is intact at its free."""
    capacity = 256 * MiB
    with Pool(policy, capacity=capacity, host_backed=True) as pool:
        run_sequence(pool, seq, capacity, host=True)


@pytest.mark.parametrize("policy", POLICIES)
def test_reserved_never_exceeds_the_cap_under_pressure(policy):
    capacity = 1 << 30
    rng = random.Random(3)
    with Pool(policy, capacity=capacity, fraction=0.5) as pool:
        live = []
        for _ in range(3000):
            if live and rng.random() < 0.45:
                pool.free(live.pop(rng.randrange(len(live))))
            else:
                try:
                    live.append(pool.malloc(rng.choice([rng.randint(1, 64 << 10), rng.randint(1, 30 * MiB)])))
                except OutOfMemoryError:
                    pass
            assert pool.stats()["total"]["reserved"]["current"] <= capacity // 2
        assert pool.stats()["ooms"] > 0  # the cap was really reached
        pool.check()


@pytest.mark.parametrize("policy", POLICIES)
def test_threads_malloc_and_free_at_once(policy):
    """Several threads allocate and free concurrently; nothing overlaps, nothing is lost."""
    capacity = 8 << 30
    pool = Pool(policy, capacity=capacity, host_backed=True)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        mine: list[tuple[int, int, int]] = []
        try:
            for _ in range(3000):
                if mine and rng.random() < 0.5:
                    ptr, size, fill = mine.pop(rng.randrange(len(mine)))
                    assert ctypes.string_at(ptr, min(size, 64)) == bytes([fill]) * min(size, 64)
                    assert ctypes.string_at(ptr + size - 1, 1) == bytes([fill])
                    pool.free(ptr)
                else:
                    size = rng.choice([rng.randint(1, 8192), rng.randint(1, 4 * MiB)])
                    ptr = pool.malloc(size, stream=seed % 2)
                    fill = rng.randint(1, 255)
                    ctypes.memset(ptr, fill, min(size, 64))
                    ctypes.memset(ptr + size - 1, fill, 1)
                    mine.append((ptr, size, fill))
            for ptr, _, _ in mine:
                pool.free(ptr)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    st = pool.stats()
    assert st["total"]["allocated"]["current"] == 0
    assert st["allocs"] == st["frees"] > 4 * 1000
    pool.check()
    pool.close()
