"""Probe the allocators on a GPU with a trace: does torch's own caching allocator fit at given caps,
where does it put its segments (docs/gpu.md, "What the GPU found"), and what does each allocator
ask of the device in every iteration on a full device (docs/gpu.md, "A full device").

    python benchmarks/gpu_probe.py fits TRACE CAP_MIB[,CAP_MIB...]     # on a GPU
    python benchmarks/gpu_probe.py record TRACE CAP_MIB OUT.pickle      # on a GPU (CAP_MIB 0: no cap)
    python benchmarks/gpu_probe.py order SNAPSHOT.pickle...             # anywhere
    python benchmarks/gpu_probe.py steady TRACE ALLOCATOR [--cap-mib N] [--repeat 3] [--device cuda] [--compact]
    python benchmarks/gpu_probe.py threads ALLOCATOR [--threads 4] [--rounds 3] [--simulated] [--json FILE]
    python benchmarks/gpu_probe.py compact ALLOCATOR [--gib 8] [--rounds 3] [--seed 0] [--json FILE]  # on a GPU

``fits`` plays the trace (.npt or .pickle) as tensors once with room to spare, then once under
each cap (``torch.cuda.set_per_process_memory_fraction`` of exactly CAP_MIB MiB, as
``npu-pool replay --live`` bisects it) and prints one JSON line per cap. ``record`` plays it once
under the cap with ``torch.cuda.memory._record_memory_history`` on and dumps the snapshot.
``order`` reads snapshots and counts, for each segment allocated while others were live, whether
it landed below all of them, above all of them, or between.

``steady`` plays the trace under one allocator (``native`` or ``npu_pool``, one process each: a
process chooses its allocator once) capped at CAP_MIB, by default at the torch model's minimum
capacity under the device's rules (the device the torch model just fits, as docs/device_calls.md's
"Steady iterations there"), ``--repeat`` times, each play as a first run, after one play with room
to spare (as ``npu-pool replay --live`` plays before it bisects: the device's address space then is
the one the torch model was checked against). It prints one JSON line: per iteration (the
stretches between ``replay.iteration_bounds``, the set-up first, the last up to
``replay.iterations_end``) the device calls the allocator
made in the first play (npu_pool: its memory calls by kind, less the address reservation;
native: the framework's num_device_alloc and num_device_free, as malloc and free), the wall
seconds of each play (synchronised at each bound), and the simulator's calls for the same
stretches (the torch model for native, the npu_pool policy for npu_pool, capped by the same memory
fraction of the same device: ``simulate_capped``).
``--device npu`` runs it under torch_npu (the tests' fake CANN: calls, not times). ``--compact``:
npu_pool with compaction (``npu_pool.set_compaction``; the simulator's pool too), and the
compactions of the first play and the simulator's beside them.

``threads`` is docs/device_calls.md's four-thread check on the device: each thread on its own
stream allocates and frees tensors of mixed sizes, filling each (a kernel, so the streams are busy
when their blocks are freed). Warm-up: every thread at its own live peak at once (the most the
workload can hold), then ``--rounds`` rounds. Then the same rounds again, timed, with the device
calls counted (npu_pool: every kind it counts; native: the framework's num_device_alloc and
num_device_free). About one free in 32 of each thread's first round checks the tensor still holds
its thread's value (a block handed to two threads at once would show). It prints one JSON line.
``--simulated`` plays the same requests on the simulator, no GPU needed, the threads taking turns
(tests/test_device_calls.py holds it to no device call after warm-up).

``compact`` measures ``npu_pool.compact()`` on the device (docs/api.md, "Compaction"). Each round
fills the device with tensors of random sizes (4 KiB to 96 MiB) and random contents up to ``--gib``
GiB, frees a random half, then times ``torch.cuda.empty_cache()`` and (npu_pool) ``compact()`` on
an idle device; each reads the reserved bytes after, the bytes copied and the device calls, and
checks every tensor's contents. Then once more with work still queued when it compacts: every held
tensor inverted in place behind 40 bf16 matrix products (the compactions it made, the tensors
whose contents changed). Then, capped at what is reserved, a request of 3/4 of the free bytes:
does it fit without compaction, and (npu_pool) with ``set_compaction(True)`` (the compactions
that request made); the contents checked again, and once more after a last fill. It prints one
JSON line (native: ``empty_cache`` alone).
"""
from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MiB = 1 << 20


def _trace(path: str) -> Any:
    from npu_pool.trace.files import open_traces

    (_, trace), *_ = open_traces(Path(path))
    return trace


def _grown(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The calls of each kind made between two counts (the kinds made only)."""
    return {k: int(after[k] - before.get(k, 0)) for k in after if after[k] != before.get(k, 0)}


def _player(path: str) -> tuple[Any, Any]:
    import torch

    from npu_pool.live import Player  # (the live replay's own player, as it plays)

    torch.cuda.set_device(0)
    return torch, Player(_trace(path), torch, torch.cuda, "cuda", None)


def steady(path: str, allocator: str, cap_mib: int | None, repeat: int, device: str,
           compact: bool = False) -> dict[str, Any]:
    """The calls and wall time of each iteration under ``allocator`` at a cap (see the module doc)."""
    from npu_pool.live import MEMORY_KINDS, Player
    from npu_pool.replay import iteration_bounds, iterations_end, min_capacity

    trace = _trace(path)
    bounds = iteration_bounds(trace)
    if not bounds:
        raise SystemExit(f"{path}: no iterations (no iteration markers, no period)")
    end = iterations_end(trace, bounds)  # (the teardown after it: no stretch, as the simulator counts)
    cuts = bounds + ([end] if end is not None else [])
    rules = "npu" if device == "npu" else "cuda"
    cap = cap_mib * MiB if cap_mib else min_capacity(trace, "torch", device=rules)[0]
    pool = None
    if allocator == "npu_pool":  # before the framework's own allocator serves anything
        from npu_pool.install import install

        pool = install(rules).get(0)
        if compact:
            pool.set_compaction(True)
    import torch

    if device == "npu":
        import torch_npu  # noqa: F401  (registers torch.npu)
    module = getattr(torch, device)
    module.set_device(0)
    player = Player(trace, torch, module, device, pool)

    # the memory calls by kind, less the address reservation (kept over the warm-up's play)
    kinds = [k for k in MEMORY_KINDS if k not in ("reserve", "release")]

    def calls() -> dict[str, int]:
        if pool is not None:
            c = pool.stats()["calls"]
            return {k: int(c[k]) for k in kinds}
        st = module.memory_stats(player.dev)
        return {"malloc": int(st.get("num_device_alloc", 0)), "free": int(st.get("num_device_free", 0))}

    player.play()  # as the live replay's minimum-capacity search: a play with room to spare first
    player.cap(cap)
    plays: list[list[tuple[float, dict[str, int]]]] = []
    failed = compactions = None

    def mark(_k: int) -> None:  # at a bound: the time and the calls so far, the device idle
        module.synchronize()
        plays[-1].append((time.perf_counter(), calls()))

    for _ in range(repeat):
        player.reset()
        plays.append([])
        mark(-1)
        failed = player.play(cuts, mark)  # (play synchronises at its end)
        mark(len(cuts))
        if len(plays) == 1 and pool is not None:
            compactions = int(pool.stats()["compactions"])
        if failed is not None:
            break
    player.cap(None)
    first = plays[0]
    live = [_grown(a[1], b[1]) for a, b in zip(first, first[1:])][:len(bounds) + 1]
    seconds = [[round(b[0] - a[0], 6) for a, b in zip(p, p[1:])][:len(bounds) + 1] for p in plays]
    sim_ok, simulated, sim_compactions = simulate_capped(trace, allocator, cap, player.total(), rules, bounds, compact)
    return {"trace": Path(path).name, "allocator": allocator, "compact": compact, "device": device, "cap_bytes": cap,
            "ok": failed is None, "fail": failed, "sim_ok": sim_ok, "iteration_calls": live,
            "simulated_calls": simulated, "same": live == simulated, "seconds": seconds,
            "compactions": compactions, "simulated_compactions": sim_compactions}


_THREAD_SIZES = (512, 4096, 100_000, MiB, 3 * MiB, 9 * MiB, 40 * MiB)


def _thread_requests(seed: int, n: int = 2000) -> list[tuple[str, int]]:
    """A thread's round: ("malloc", bytes) or ("free", index into its held list), at most 17 held."""
    import random

    rng = random.Random(seed)
    out: list[tuple[str, int]] = []
    held = 0
    for _ in range(n):
        out.append(("malloc", rng.choice(_THREAD_SIZES)))
        held += 1
        if held > 16:
            out.append(("free", rng.randrange(held)))
            held -= 1
    return out


class _TorchSide:
    """``threads`` on the GPU: tensors on a stream per thread, filled with the thread's value."""

    def __init__(self, allocator: str) -> None:
        self.pool = None
        if allocator == "npu_pool":  # before the framework's own allocator serves anything
            from npu_pool.install import install

            self.pool = install("cuda").get(0)
        import torch

        self.torch = torch
        torch.cuda.set_device(0)

    def thread(self) -> Any:  # the context a thread works in: a stream of its own
        return self.torch.cuda.stream(self.torch.cuda.Stream())

    def malloc(self, size: int, value: int) -> Any:
        t = self.torch.empty(size, dtype=self.torch.uint8, device="cuda")
        t.fill_(value)
        return t

    def free(self, t: Any, value: int, check: bool) -> bool:
        """Whether the tensor kept its value (checked when asked: a read waits for the stream); the
        caller's dropping the tensor frees it."""
        return not check or int(t[-1].item()) == value

    def sync(self) -> None:
        self.torch.cuda.current_stream().synchronize()

    def calls(self) -> dict[str, int]:
        if self.pool is not None:
            return {k: int(v) for k, v in self.pool.stats()["calls"].items()}
        st = self.torch.cuda.memory_stats(0)
        return {"malloc": int(st.get("num_device_alloc", 0)), "free": int(st.get("num_device_free", 0))}

    def peaks(self) -> tuple[int, int]:
        return int(self.torch.cuda.max_memory_reserved(0)), int(self.torch.cuda.max_memory_allocated(0))


def live_peak(requests: list[tuple[str, int]]) -> tuple[int, int]:
    """A thread's requests ("malloc", bytes) / ("free", index into its held list): how many of them
    take it to its live peak, and its live bytes there."""
    held: list[int] = []
    live = best = at = 0
    for k, (op, x) in enumerate(requests):
        if op == "malloc":
            held.append(x)
            live += x
        else:
            live -= held.pop(x)
        if live > best:
            best, at = live, k + 1
    return at, best


def threads_simulated(allocator: str, n_threads: int, rounds: int, capacity: int = 80 << 30) -> dict[str, Any]:
    """``threads --simulated``: the same requests to a simulated device of ``capacity`` bytes (the
    torch model for ``native``), a stream id per thread, the threads taking one request each in
    turn (the same interleaving on every run, unlike threads)."""
    from npu_pool import Pool
    from npu_pool.live import SIMULATED

    def play(p: Pool, k: int, requests: list[tuple[str, int]], held: list[int]) -> Any:
        """Thread k's requests, one per step; what it still holds at the end stays in ``held``."""
        for op, x in requests:
            if op == "malloc":
                held.append(p.malloc(x, stream=k + 1))
            else:
                p.free(held.pop(x))
            yield

    def in_turn(p: Pool, reqs: list[list[tuple[str, int]]]) -> None:
        """One round of every thread, a request of each in turn, each freeing what it held after."""
        helds: list[list[int]] = [[] for _ in reqs]
        plays = [play(p, k, r, helds[k]) for k, r in enumerate(reqs)]
        while plays:
            plays = [g for g in plays if next(g, StopIteration) is not StopIteration]
        for ptr in (ptr for held in helds for ptr in held):
            p.free(ptr)

    with Pool(SIMULATED[allocator], capacity=capacity) as p:
        reqs = [_thread_requests(k) for k in range(n_threads)]
        in_turn(p, [r[:live_peak(r)[0]] for r in reqs])  # every thread at its live peak at once, at the end
        for _ in range(rounds):
            in_turn(p, reqs)
        before = dict(p.stats()["calls"])
        for _ in range(rounds):
            in_turn(p, reqs)
        after, total = p.stats()["calls"], p.stats()["total"]
    grew = _grown(before, after)
    return {"allocator": allocator, "simulated": True, "ok": True, "bad": [], "threads": n_threads, "rounds": rounds,
            "requests_timed": n_threads * rounds * len(reqs[0]), "calls_after_warm_up": grew, "seconds_timed": 0.0,
            "peak_reserved": int(total["reserved"]["peak"]), "peak_allocated": int(total["allocated"]["peak"])}


def threads(allocator: str, n_threads: int, rounds: int) -> dict[str, Any]:
    """The four-thread check on the GPU (see the module doc)."""
    import threading

    side = _TorchSide(allocator)

    bad: list[str] = []

    def serve(value: int, requests: list[tuple[str, int]], check: bool) -> list[Any]:
        held: list[Any] = []
        for i, (op, x) in enumerate(requests):
            if op == "malloc":
                held.append(side.malloc(x, value))
            elif not side.free(held.pop(x), value, check and i % 64 == 1) and check:
                bad.append(f"thread {value}: a tensor lost its value")
                check = False
        return held

    def release(held: list[Any], value: int) -> None:
        for t in held:
            side.free(t, value, False)
        held.clear()

    phases = [threading.Barrier(n_threads + 1, timeout=600) for _ in range(3)]
    held_peaks = threading.Barrier(n_threads, timeout=600)
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            requests = _thread_requests(k)
            with side.thread():
                held = serve(k + 1, requests[:live_peak(requests)[0]], False)
                side.sync()
                held_peaks.wait()  # every thread at its live peak at once
                release(held, k + 1)
                for phase in range(2):  # the warm-up's rounds, then the timed ones
                    for r in range(rounds):
                        release(serve(k + 1, requests, r == 0), k + 1)
                    side.sync()
                    phases[phase].wait()
                    if phase == 0:
                        phases[2].wait()
        except BaseException as e:  # (the main thread reports it; a broken barrier releases the others)
            errors.append(e)
            for b in (*phases, held_peaks):
                b.abort()

    ts = [threading.Thread(target=work, args=(k,)) for k in range(n_threads)]
    for t in ts:
        t.start()
    timed = 0.0
    before: dict[str, int] = {}
    try:
        phases[0].wait()
        before = side.calls()
        t0 = time.perf_counter()
        phases[2].wait()
        phases[1].wait()
        timed = time.perf_counter() - t0
    except threading.BrokenBarrierError:
        pass
    for t in ts:
        t.join()
    if errors:
        return {"allocator": allocator, "ok": False, "error": repr(errors[0])[:400]}
    after = side.calls()
    reserved, allocated = side.peaks()
    grew = _grown(before, after)
    return {"allocator": allocator, "ok": not bad, "bad": bad[:4], "threads": n_threads,
            "rounds": rounds, "requests_timed": n_threads * rounds * len(_thread_requests(0)),
            "calls_after_warm_up": grew, "seconds_timed": round(timed, 4),
            "peak_reserved": reserved, "peak_allocated": allocated}


def simulate_capped(trace: Any, allocator: str, cap: int, total: int, rules: str, bounds: list[int],
                    compact: bool = False) -> tuple[bool, list[dict[str, int]], int]:
    """The simulator's side of ``steady``: whether the model of ``allocator`` runs the trace, and its
    device calls in each stretch, on a ``total``-byte device capped at ``cap`` bytes by a memory
    fraction as the live play is (a framework's allocator then refuses past the cap without asking
    the device; on a device of ``cap`` bytes it would ask and be refused, calls the framework's
    counters leave out). Kinds as the live side counts them (no address reservation; native: the
    segment mallocs and frees); and its compactions (``compact``: npu_pool with compaction)."""
    from npu_pool.live import MEMORY_KINDS, SIMULATED, cap_fraction
    from npu_pool.replay import run

    kinds = [k for k in MEMORY_KINDS if k not in ("reserve", "release")]
    if allocator == "native":  # the torch model's segments are the framework's device allocations
        kinds = ["malloc", "free"]
    total = max(total, cap)
    sim = run(trace, SIMULATED[allocator], total, device=rules, bounds=bounds, fraction=cap_fraction(cap, total),
              compact=compact)
    return sim.ok, [{k: d[k] for k in kinds if d.get(k)} for d in sim.iteration_calls or []], sim.stats["compactions"]


_COMPACT_SIZES = (4096, 300_000, MiB + 4096, 5 * MiB + 12_288, 17 * MiB, 33 * MiB + 4096, 96 * MiB)


def compact(allocator: str, gib: float, rounds: int, seed: int, device: str = "cuda") -> dict[str, Any]:
    """``compact`` on the GPU (see the module doc): what ``empty_cache`` and ``npu_pool.compact()``
    give back once half the tensors are freed, how long each takes, and whether every tensor kept
    its contents."""
    import random

    pool = None
    if allocator == "npu_pool":  # before the framework's own allocator serves anything
        from npu_pool.install import install

        pool = install("cuda").get(0)
    import torch

    from npu_pool.live import cap_fraction

    cuda = torch.cuda
    cuda.set_device(0)
    rng = random.Random(seed)
    held: dict[int, tuple[Any, int]] = {}  # key -> (tensor, the seed of its contents)
    made = [seed * 1_000_003]

    def contents(size: int, s: int) -> Any:
        g = torch.Generator(device=device)
        g.manual_seed(s)
        return torch.randint(0, 256, (size,), dtype=torch.uint8, device=device, generator=g)

    def fill(live: int) -> None:  # tensors of random sizes and contents up to ``live`` bytes held
        while sum(t.numel() for t, _ in held.values()) < live:
            made[0] += 1
            held[made[0]] = (contents(rng.choice(_COMPACT_SIZES), made[0]), made[0])

    def free_half() -> None:
        for k in rng.sample(sorted(held), len(held) // 2):
            del held[k]

    def changed() -> int:  # the tensors whose contents are not what they were given
        return sum(not torch.equal(t, contents(t.numel(), s)) for t, s in held.values())

    def calls() -> dict[str, int]:
        if pool is not None:
            return {k: int(v) for k, v in pool.stats()["calls"].items()}
        st = cuda.memory_stats(0)
        return {"malloc": int(st.get("num_device_alloc", 0)), "free": int(st.get("num_device_free", 0))}

    def timed(f: Any) -> tuple[Any, float]:
        t0 = time.perf_counter()
        out = f()
        cuda.synchronize()
        return out, round(time.perf_counter() - t0, 6)

    out: dict[str, Any] = {"allocator": allocator, "gib": gib, "seed": seed, "rounds": []}
    for _ in range(rounds):  # on an idle device: the copies' time alone
        fill(int(gib * (1 << 30)))
        free_half()
        cuda.synchronize()
        row: dict[str, Any] = {"tensors": len(held), "allocated": int(cuda.memory_allocated(0)),
                               "reserved": int(cuda.memory_reserved(0))}
        c0 = calls()
        _, row["empty_cache_s"] = timed(cuda.empty_cache)
        row["after_empty_cache"] = int(cuda.memory_reserved(0))
        if pool is not None:
            copied = int(pool.stats()["compacted"])
            row["returned"], row["compact_s"] = timed(pool.compact)
            row["copied"] = int(pool.stats()["compacted"]) - copied
            row["after_compact"] = int(cuda.memory_reserved(0))
        row["calls"] = _grown(c0, calls())
        row["changed"] = changed()
        out["rounds"].append(row)
    # Work still queued when the pool compacts: every held tensor inverted in place (no allocation)
    # behind 40 matrix products on buffers taken before the half is freed; each inversion must land.
    fill(int(gib * (1 << 30)))
    a = torch.ones(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    free_half()
    cuda.empty_cache()
    for _ in range(20):
        torch.matmul(a, a, out=b)
        torch.matmul(b, b, out=a)
    for t, _s in held.values():
        t.bitwise_not_()
    queued: dict[str, Any] = {"tensors": len(held)}
    if pool is not None:
        before = int(pool.stats()["compactions"])
        queued["returned"] = pool.compact()  # (it synchronises the device first)
        queued["compactions"] = int(pool.stats()["compactions"]) - before
    cuda.synchronize()
    for t, _s in held.values():
        t.bitwise_not_()  # back to the contents given, for changed()
    del a, b
    queued["changed"] = changed()
    out["queued"] = queued
    # At an out-of-memory: capped at what is reserved now, a request of 3/4 of what it does not hold.
    free_half()
    cuda.empty_cache()
    reserved, allocated = int(cuda.memory_reserved(0)), int(cuda.memory_allocated(0))
    ask = (reserved - allocated) * 3 // 4 // (2 * MiB) * (2 * MiB)
    cuda.set_per_process_memory_fraction(cap_fraction(reserved, cuda.get_device_properties(0).total_memory), 0)
    oom: dict[str, Any] = {"cap": reserved, "allocated": allocated, "ask": ask}

    def fits() -> bool:
        try:
            t = torch.empty(ask, dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError:
            return False
        del t
        return True

    oom["fits"] = fits()
    if pool is not None:
        pool.set_compaction(True)
        before = int(pool.stats()["compactions"])
        oom["fits_compacting"], oom["seconds"] = timed(fits)
        oom["compactions"] = int(pool.stats()["compactions"]) - before
        pool.set_compaction(False)
    cuda.set_per_process_memory_fraction(1.0, 0)
    oom["changed"] = changed()
    out["oom"] = oom
    fill(int(gib * (1 << 30)))  # the pool serves on after all this
    out["changed_at_end"] = changed()
    return out


def order(snapshots: list[str]) -> None:
    for path in snapshots:
        with open(path, "rb") as f:
            snap = pickle.load(f)  # (your own recordings: pickle runs what a file says)
        live: set[int] = set()
        below = above = between = 0
        for e in snap["device_traces"][0]:
            if e["action"] == "segment_alloc":
                if live:
                    below += e["addr"] < min(live)
                    above += e["addr"] > max(live)
                    between += min(live) < e["addr"] < max(live)
                live.add(e["addr"])
            elif e["action"] == "segment_free":
                live.discard(e["addr"])
        print(json.dumps({"snapshot": Path(path).name, "below_all": below, "above_all": above, "between": between}))


def _emit(result: dict[str, Any], path: str | None) -> None:
    """Print the result as one JSON line, and write it to ``path`` too (when given)."""
    line = json.dumps(result)
    print(line)
    if path:
        Path(path).write_text(line + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    f = sub.add_parser("fits")
    f.add_argument("trace")
    f.add_argument("caps", help="MiB, comma separated")
    r = sub.add_parser("record")
    r.add_argument("trace")
    r.add_argument("cap", type=int, help="MiB (0: no cap)")
    r.add_argument("out")
    o = sub.add_parser("order")
    o.add_argument("snapshots", nargs="+")
    s = sub.add_parser("steady")
    s.add_argument("trace")
    s.add_argument("allocator", choices=("native", "npu_pool"))
    s.add_argument("--cap-mib", type=int, default=None, help="default: the torch model's minimum capacity")
    s.add_argument("--repeat", type=int, default=3)
    s.add_argument("--device", choices=("cuda", "npu"), default="cuda")
    s.add_argument("--compact", action="store_true", help="npu_pool with compaction (npu_pool.set_compaction)")
    h = sub.add_parser("threads")
    h.add_argument("allocator", choices=("native", "npu_pool"))
    h.add_argument("--threads", type=int, default=4)
    h.add_argument("--rounds", type=int, default=3)
    h.add_argument("--simulated", action="store_true",
                   help="on the simulator (no GPU): a stream id per thread, one request of each in turn")
    h.add_argument("--capacity-mib", type=int, default=80 << 10, help="the simulated device (default 80 GiB)")
    c = sub.add_parser("compact")
    c.add_argument("allocator", choices=("native", "npu_pool"))
    c.add_argument("--gib", type=float, default=8.0, help="the live bytes each round fills up to (GiB)")
    c.add_argument("--rounds", type=int, default=3)
    c.add_argument("--seed", type=int, default=0)
    for p in (h, c):
        p.add_argument("--json", help="write the JSON line to this file too")
    args = ap.parse_args(argv)
    if args.mode == "compact":
        if not 0 < args.gib <= 1024 or args.rounds < 1 or args.seed < 0:
            ap.error("--gib takes a size in (0, 1024], --rounds a positive number, --seed one of 0 or more")
        _emit(compact(args.allocator, args.gib, args.rounds, args.seed), args.json)
        return 0
    if args.mode == "threads":
        if args.threads < 1 or args.rounds < 1 or args.capacity_mib < 1:
            ap.error("--threads, --rounds and --capacity-mib take a positive number")
        if args.simulated:
            _emit(threads_simulated(args.allocator, args.threads, args.rounds, args.capacity_mib << 20), args.json)
        else:
            _emit(threads(args.allocator, args.threads, args.rounds), args.json)
        return 0
    if args.mode == "order":
        order(args.snapshots)
        return 0
    if args.mode == "steady":
        if args.repeat < 1 or (args.cap_mib is not None and args.cap_mib < 1):
            ap.error("--repeat and --cap-mib take a positive number")
        if args.compact and args.allocator != "npu_pool":
            ap.error("--compact applies to npu_pool")
        print(json.dumps(steady(args.trace, args.allocator, args.cap_mib, args.repeat, args.device, args.compact)))
        return 0
    torch, player = _player(args.trace)
    if args.mode == "fits":
        player.play()
        player.reset()  # as the live replay: a room-to-spare play first
        for mib in (int(c) for c in args.caps.split(",")):
            player.cap(mib * MiB if mib else None)
            player.reset()
            failed = player.play()
            player.reset()
            print(json.dumps({"trace": args.trace, "cap_mib": mib, "ok": failed is None, "fail": failed}))
        player.cap(None)
    else:
        player.cap(args.cap * MiB if args.cap else None)
        torch.cuda.memory._record_memory_history(max_entries=10**6, context=None, stacks="python")
        failed = player.play()
        torch.cuda.memory._dump_snapshot(args.out)
        print(json.dumps({"trace": args.trace, "cap_mib": args.cap, "ok": failed is None, "fail": failed}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
