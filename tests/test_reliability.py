"""Reliability under teardown and fork races, half installs and hostile cache or trace files
(issue 21): closing a pool while threads use it, forking while a thread is inside it, a truncated
cached hooks library, a FIFO among traces, a bad plan at install, a foreign simulated pointer,
statistics of a device torch lacks. Races run in a child process, so that a crash or a hang is a
failed assertion rather than a dead test run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from conftest import ROOT, TorchNpu, unavailable
from npu_pool.pool import Pool, PoolError, UnknownPointerError
from npu_pool.trace.files import expand, open_traces
from npu_pool.trace.format import OP_ALLOC, OP_FREE, PLAN_MAGIC, Trace, TraceError

MiB = 1 << 20


def _python(code: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          cwd=str(ROOT), env=env)


def _last_json(r: subprocess.CompletedProcess) -> dict:
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and lines, f"exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return json.loads(lines[-1])


# -- 1. close while other threads malloc/free ------------------------------------------------

CLOSE_RACE = """
import json, threading, time
from npu_pool.pool import Pool, PoolError
refused, other, survived = 0, [], 0
lock = threading.Lock()
for rep in range(24):
    pool = Pool(("torch", "npu_pool", "expandable", "planned")[rep % 4], capacity=1 << 30, host_backed=rep % 2 == 1)
    def worker(seed):
        global refused, survived
        live = []
        try:
            for n in range(100000):
                live.append(pool.malloc(4096 * (1 + (n + seed) % 50)))
                if len(live) > 16:
                    pool.free(live.pop(0))
                if n % 7 == 0:
                    pool.stats()
            with lock:
                survived += 1
        except PoolError as e:
            with lock:
                if e.code == 7 and "closed pool" in str(e):
                    refused += 1
                else:
                    other.append(repr(e))
        except Exception as e:
            with lock:
                other.append(repr(e))
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.005)
    pool.close()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    try:  # after the close: a clear error, not a read of freed memory
        pool.malloc(4096)
        after = "served"
    except PoolError as e:
        after = str(e)
    pool.close()  # twice: nothing
print(json.dumps({"refused": refused, "other": other, "survived": survived, "after": after}))
"""


def test_close_while_threads_allocate_refuses_them_cleanly() -> None:
    """8 threads malloc/free/stats while the main thread closes the pool, 24 times over every
    policy (host-backed memory half the time): no crash or hang, each racing call fails with
    PoolError "closed pool" (or its thread had finished), and calls after the close fail too."""
    out = _last_json(_python(CLOSE_RACE))
    assert out["other"] == []
    assert out["refused"] + out["survived"] == 24 * 8
    assert out["refused"] >= 24  # the close did race with running threads
    assert "closed pool" in out["after"]


def test_closed_pool_refuses_every_call_but_close() -> None:
    p = Pool(capacity=1 << 30)
    ptr = p.malloc(MiB)
    p.close()
    for call in (lambda: p.malloc(1), lambda: p.free(ptr), p.stats, p.blocks, p.empty_cache, p.check,
                 lambda: p.mark("iter_begin"), p.history):
        with pytest.raises(PoolError, match="closed pool"):
            call()
    p.close()


def test_a_snapshot_taken_while_another_thread_allocates_is_one_state_of_the_pool() -> None:
    """pool_snapshot (torch's memory._snapshot() once installed, OOM snapshots) reads each pool at
    one instant (Pool.view). Before, it read statistics, history, blocks and mapped ranges in four
    calls while another thread allocated (torch's autograd threads do): ~30% of snapshots reported
    memory held outside every segment on a policy that holds none, and most had allocated blocks
    their own trace did not (a review of the Python layer under threads, a helper)."""
    import random
    import threading

    from npu_pool.snapshot import pool_snapshot

    MiB = 1 << 20
    pool = Pool("torch", capacity=8 << 30)
    stop = threading.Event()

    def churn() -> None:
        r, live = random.Random(1), []
        while not stop.is_set():
            if len(live) < 8 and r.random() < 0.55:
                live.append(pool.malloc(r.choice([30, 50, 70]) * MiB))  # large blocks: a segment each
            elif live:
                pool.free(live.pop(r.randrange(len(live))))
            if r.random() < 0.2:
                pool.empty_cache()  # segments come and go

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    t = threading.Thread(target=churn)
    t.start()
    unmapped = differ = 0
    try:
        for _ in range(150):
            snap = pool_snapshot({0: pool})
            unmapped += bool(snap["allocator_settings"]["npu_pool_unmapped_bytes"])
            live: dict[int, int] = {}
            for e in snap["device_traces"][0]:
                if e["action"] == "alloc":
                    live[e["addr"]] = e["size"]
                elif e["action"] == "free_completed":
                    live.pop(e["addr"], None)
            allocated = {b["address"] for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"}
            differ += set(live) != allocated
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
        pool.close()
    assert (unmapped, differ) == (0, 0)


# -- 2. fork while another thread is inside the pool -----------------------------------------

# Both scripts below fork while their threads work: n children a few ms apart, each running
# child() under an alarm (a hang dies of SIGALRM) and exiting with what it returns (4: it raised).
_FORKS = """
import os, signal, time
def fork_children(child, n=12):
    statuses = []
    for _ in range(n):
        time.sleep(0.005)
        pid = os.fork()
        if pid == 0:
            signal.alarm(10)
            try:
                code = child()
            except BaseException:
                code = 4
            os._exit(code)
        statuses.append(os.waitpid(pid, 0)[1])
    return statuses
"""

FORK_RACE = _FORKS + """
import json, os, signal, threading, time
from npu_pool._core import ffi, lib
from npu_pool.pool import Pool
pool = Pool("torch", capacity=8 << 30)
keep = [pool.malloc(512) for _ in range(40000)]  # a long walk under the lock in np_blocks
stop = threading.Event()
def inside():
    ctx, n, buf = pool.ctx, ffi.new("size_t *"), ffi.new("np_block_info[]", 50000)
    while not stop.is_set():
        lib.np_blocks(ctx, buf, 50000, n)
def churn():
    while not stop.is_set():
        pool.free(pool.malloc(1 << 20))
threads = [threading.Thread(target=inside), threading.Thread(target=churn)]
for t in threads:
    t.start()
def child():
    st = pool.stats()
    p = pool.malloc(4096)  # a simulated device is host memory: the child's own copy
    pool.free(p)
    pool.check()
    pool.close()
    return 0 if st["total"]["allocated"]["current"] >= 40000 * 512 else 3
statuses = fork_children(child)
stop.set()
for t in threads:
    t.join()
pool.check()
print(json.dumps({"statuses": statuses}))
"""


def test_fork_while_threads_are_inside_the_pool() -> None:
    """A forked child reads the statistics, allocates, checks and closes the pool even when
    another thread held the pool's lock at fork() (before: the child hung in np_get_stats)."""
    out = _last_json(_python(FORK_RACE))
    assert out["statuses"] == [0] * 12


FORK_IN_REGION = _FORKS + """
import json, os, signal, threading, time
from npu_pool.install import _lock
from npu_pool.pool import Pool
pool = Pool("npu_pool", capacity=1 << 30)
stop = threading.Event()
def churn():  # enters and leaves a region without end: its Python lock is often held
    while not stop.is_set():
        with pool.region("train"):
            pool.free(pool.malloc(4096))
t = threading.Thread(target=churn)
t.start()
def child():
    before = pool.tags()["train"]["allocated"]  # the parent's thread may have held a block
    with pool.region("train"):
        pool.free(pool.malloc(4096))
    return 0 if pool.tags()["train"]["allocated"] == before else 3
statuses = fork_children(child)
stop.set()
t.join()
def fork_holding():  # a fork by the thread that holds a module lock (twice): its child leaves both withs, takes it again
    with _lock:
        with _lock:
            pid = os.fork()
            if pid == 0:
                signal.alarm(10)
    if pid == 0:
        with _lock:
            os._exit(0)
    return os.waitpid(pid, 0)[1]
statuses.append(fork_holding())
with _lock:
    pass  # the parent's lock is free again
forks = []
def handler(sig, frame):  # a fork from a signal handler, which may land inside the main thread's with
    if not getattr(handler, "busy", False):
        handler.busy = True
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        forks.append(os.waitpid(pid, 0)[1])
        handler.busy = False
signal.signal(signal.SIGALRM, handler)
signal.setitimer(signal.ITIMER_REAL, 0.005, 0.005)
t0 = time.time()
while time.time() - t0 < 1.5 and len(forks) < 40:
    with _lock:
        pass
signal.setitimer(signal.ITIMER_REAL, 0)
statuses.append(int(len(forks) < 10 or any(forks)))
print(json.dumps({"statuses": statuses}))
"""


def test_fork_while_a_thread_enters_a_region() -> None:
    """A forked child enters a tagged region even when another thread was entering or leaving one
    at fork() (before: the child hung on pool.py's Python lock, which the thread held); the
    package's module locks are all of that kind (npu_pool.locks). A fork from a signal handler
    that lands inside the main thread's with does not wait for that thread (a first version
    did, for ever)."""
    out = _last_json(_python(FORK_IN_REGION))
    assert out["statuses"] == [0] * 14


TWO_FORKERS = """
import json, os, sys, threading
sys.setswitchinterval(1e-6)
from npu_pool.pool import Pool, _REGIONS_LOCK
pool = Pool("npu_pool", capacity=1 << 30)
def forker():
    for _ in range(40):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
hung = free = 0
for _ in range(10):
    ts = [threading.Thread(target=forker, daemon=True) for _ in range(2)]
    for t in ts: t.start()
    for t in ts: t.join(20)
    hung += any(t.is_alive() for t in ts)
    if hung:
        break
    got = []
    def probe():  # another thread takes the lock: it is free again
        if _REGIONS_LOCK._lock.acquire(timeout=5):
            got.append(1)
            _REGIONS_LOCK._lock.release()
    p = threading.Thread(target=probe)
    p.start(); p.join()
    free += bool(got)
if not hung and free == 10:
    with pool.region("train"):  # what the lock guards works on
        pool.free(pool.malloc(4096))
print(json.dumps({"hung": hung, "free": free}), flush=True)
os._exit(0)  # (a hung forking thread would hold up the exit)
"""


def test_two_threads_forking_at_once_leave_the_module_locks_free() -> None:
    """Two threads forking at once (two DataLoaders, two multiprocessing starts): the second fork's
    hook waits for the first's to release a module lock, then takes it; each fork releases what its
    own hook took. Before, one flag per lock: the first fork's release cleared the second's, which
    kept the lock for ever (its next fork, or any region, recorder marker or install, hung; a review
    of the Python layer under threads, 3 of 3 runs)."""
    out = _last_json(_python(TWO_FORKERS))
    assert out == {"hung": 0, "free": 10}


FORK_AT_FIRST_OOM = """
import faulthandler, json, os, sys, tempfile, threading
os.environ["NPU_POOL_OOM_SNAPSHOT"] = tempfile.mkdtemp()
sys.setswitchinterval(1e-6)
from npu_pool.pool import Pool, OutOfMemoryError
pool = Pool("torch", capacity=1 << 26)
def first_oom():
    try:
        pool.malloc(1 << 40)
    except OutOfMemoryError:
        pass
t = threading.Thread(target=first_oom)
t.start()
hung = 0
for i in range(40):
    pid = os.fork()
    if pid == 0:
        faulthandler.dump_traceback_later(8, exit=True)  # a hang: exit 1
        try:
            pool.malloc(1 << 40)
        except OutOfMemoryError:
            pass
        os._exit(0)
    hung += os.waitpid(pid, 0)[1] != 0
t.join()
print(json.dumps({"hung": hung}))
"""


def test_a_child_forked_while_a_thread_writes_the_first_oom_snapshot_fails_its_own_cleanly() -> None:
    """A fork while another thread writes the process's first OOM snapshot: the child's own first
    OOM writes its snapshot too. Before, the writers imported a module at first use, and the
    child waited for ever on that import's lock, held by a thread it does not have (a review of
    the Python layer under threads, a helper)."""
    for _ in range(6):  # fresh processes: only a process's first snapshot imported anything
        assert _last_json(_python(FORK_AT_FIRST_OOM)) == {"hung": 0}


# -- 3. a truncated hooks library in the cache -------------------------------------------------

def test_the_first_histories_of_a_process_may_come_from_many_threads_at_once() -> None:
    """Several threads failing at once each convert the history (OOM snapshots, explain): the
    event layout was made at the first conversion, and two threads making it left it broken for
    the rest of the process ('too many values to unpack'; 5 of 15 fresh processes in the threads
    review). Each fresh process here converts its first histories from 8 threads at once."""
    code = """
import sys, threading, npu_pool
sys.setswitchinterval(1e-6)
p = npu_pool.Pool("npu_pool", capacity=1 << 30)
p.free(p.malloc(4096))
bar, errs = threading.Barrier(8), []
def first():
    bar.wait()
    try:
        assert [e["kind"] for e in p.history()] == ["segment_map", "alloc", "free"]
    except Exception as e:
        errs.append(repr(e))
ts = [threading.Thread(target=first) for _ in range(8)]
for t in ts: t.start()
for t in ts: t.join()
print(errs)
"""
    for _ in range(5):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=str(ROOT))
        assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr[-2000:])


def test_cached_hooks_library_is_verified_before_loading(tmp_path, monkeypatch) -> None:
    """The hooks cache keeps a size and checksum beside each library; a truncated or altered
    library (which would kill the process with SIGBUS when loaded) is rebuilt instead."""
    from npu_pool import cpp_hooks

    src = tmp_path / "hooks.c"
    src.write_text("int npu_pool_hooks_probe(void) { return 42; }\n" + "/* padding */\n" * 200)
    builds = []
    run = subprocess.run

    def compile_counted(cmd: list[str], **kw: object) -> subprocess.CompletedProcess:
        builds.append(cmd[-1])
        return run(cmd, **kw)

    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(cpp_hooks, "_compiler", lambda: [os.environ.get("CC", "") or "gcc"])
    monkeypatch.setattr(cpp_hooks, "_command", lambda cxx, kind: [*cxx, "-shared", "-fPIC", "-x", "c", str(src)])
    monkeypatch.setattr(cpp_hooks.subprocess, "run", compile_counted)
    monkeypatch.setattr(cpp_hooks, "_key", lambda cxx, kind: "test")
    monkeypatch.setenv(cpp_hooks.CACHE_ENV, str(tmp_path / "cache"))
    try:
        lib = cpp_hooks.build()
    except cpp_hooks.HooksUnavailable as e:
        unavailable(f"no C compiler: {e}")
    assert len(builds) == 1 and lib.with_name(lib.name + ".sum").is_file()
    whole = lib.read_bytes()
    assert cpp_hooks.build() == lib and len(builds) == 1  # verified: reused
    lib.write_bytes(whole[: len(whole) // 3])  # truncated, as a full disk or a killed copy leaves it
    assert cpp_hooks.build() == lib and len(builds) == 2 and lib.read_bytes() == whole
    flipped = bytearray(whole)
    flipped[len(flipped) // 2] ^= 0xFF  # same size, other bytes
    lib.write_bytes(bytes(flipped))
    assert cpp_hooks.build() == lib and len(builds) == 3 and lib.read_bytes() == whole
    lib.with_name(lib.name + ".sum").unlink()  # a library without its checksum (an older cache)
    assert cpp_hooks.build() == lib and len(builds) == 4
    import ctypes
    assert ctypes.CDLL(str(lib)).npu_pool_hooks_probe() == 42


def test_cxx_with_words_is_a_command_not_a_program_name(monkeypatch) -> None:
    """CXX="ccache g++" (or "nice g++") was run as one program name, so the C++ hooks were lost
    (record_stream then protected nothing) with only a warning: it is split as a shell would,
    and a value no shell could read is refused saying so."""
    from npu_pool import cpp_hooks

    monkeypatch.setenv("CXX", "  nice -n 5 'g++'  ")
    assert cpp_hooks._compiler() == ["nice", "-n", "5", "g++"]
    monkeypatch.setenv("CXX", "g++ 'unclosed")
    with pytest.raises(cpp_hooks.HooksUnavailable, match="CXX=.* cannot be read as a command"):
        cpp_hooks._compiler()
    monkeypatch.setenv("CXX", " ")
    assert len(cpp_hooks._compiler()) == 1  # (unset: g++ or c++ on the PATH, when there is one)


# -- 4. a FIFO among the traces -----------------------------------------------------------------

def _trace(path: Path) -> Path:
    t = Trace(meta={"origin": "test", "n_ids": 1})
    t.append(OP_ALLOC, id=0, size=4096)
    t.append(OP_FREE, id=0, size=4096)
    t.save(path)
    return path


def test_fifo_named_like_a_trace_is_never_opened(tmp_path) -> None:
    d = tmp_path / "traces"
    d.mkdir()
    good = _trace(d / "a.npt")
    os.mkfifo(d / "b.npt")
    assert expand([str(d)]) == [good]
    with pytest.raises(TraceError, match="not a regular file .a FIFO."):
        open_traces(d / "b.npt")
    only = tmp_path / "only"
    only.mkdir()
    os.mkfifo(only / "x.pickle")
    with pytest.raises(TraceError, match="not regular files"):
        expand([str(only)])
    r = subprocess.run([sys.executable, "-m", "npu_pool.cli", "replay", str(d)], capture_output=True, text=True,
                       timeout=60, cwd=str(ROOT), env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", "npu_pool.cli", "replay", str(d / "b.npt")], capture_output=True,
                       text=True, timeout=60, cwd=str(ROOT), env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode != 0 and "not a regular file" in r.stderr and "Traceback" not in r.stderr


# -- 6. another simulated device's pointer -------------------------------------------------------

def test_pointer_of_another_simulated_device_is_foreign() -> None:
    with Pool(capacity=1 << 30, device=0) as a, Pool(capacity=1 << 30, device=1) as b:
        pa, pb = a.malloc(MiB), b.malloc(MiB)
        assert pa != pb
        with pytest.raises(UnknownPointerError, match="foreign pointer"):
            a.free(pb)
        assert a.stats()["total"]["allocated"]["current"] == MiB and a.block_size(pa) == MiB
        a.free(pa)
        b.free(pb)
        a.check()
        b.check()


# -- under the real torch_npu ---------------------------------------------------------------------

BAD_PLANS = """
import json, os, sys, torch, torch_npu
import npu_pool
from npu_pool._core import ffi, lib
from npu_pool.install import installed
stats_fn = torch_npu._C._npu_memoryStats
errors = {}
for name in sys.argv[1:]:
    os.environ.update(NPU_POOL_POLICY="planned", NPU_POOL_PLAN=name)
    try:
        npu_pool.install()
        errors[name] = "installed"
    except Exception as e:
        errors[name] = type(e).__name__ + ": " + str(e)
x = torch.empty(1 << 18, device="npu")  # served by torch_npu's own allocator
print(json.dumps({"errors": errors, "installed": sorted(installed()), "ctx": lib.npu_pool_existing_ctx(0) != ffi.NULL,
                  "stats_fn_untouched": torch_npu._C._npu_memoryStats is stats_fn,
                  "torch_counts": torch.npu.memory_allocated()}))
"""


def test_a_bad_plan_leaves_torch_untouched(torch_npu: TorchNpu, tmp_path: Path) -> None:
    """NPU_POOL_POLICY=planned with an empty, truncated or wrong-kind plan: install() raises and
    torch keeps its own allocator (before: PlanError after the swap)."""
    empty = tmp_path / "empty.plan"
    empty.write_bytes(b"")
    truncated = tmp_path / "truncated.plan"
    truncated.write_bytes(PLAN_MAGIC + b"\x01\x00\x00")
    trace = _trace(tmp_path / "trace.npt")
    code = BAD_PLANS.replace("sys.argv[1:]", repr([str(empty), str(truncated), str(trace)]))
    out, err = torch_npu.results(code)
    assert all(e.startswith(("PlanError", "ConfigError")) for e in out["errors"].values()), out["errors"]
    assert out["installed"] == [] and not out["ctx"] and out["stats_fn_untouched"]
    assert out["torch_counts"] >= 1 << 20  # torch_npu's allocator served the tensor and counts it
    assert "Traceback" not in err


DEVICE_ARGS = """
import json, torch, torch_npu
if INSTALL:
    import npu_pool
    npu_pool.install()
x = torch.empty(1 << 18, device="npu")
r = {"count": torch.npu.device_count(), "ok": torch.npu.memory_allocated(1) >= 0}
for name, call in (("memory_stats(5)", lambda: torch.npu.memory_stats(5)),
                   ("memory_allocated(-7)", lambda: torch.npu.memory_allocated(-7)),
                   ("max_memory_reserved(9)", lambda: torch.npu.max_memory_reserved(9)),
                   ("reset_peak_memory_stats(9)", lambda: torch.npu.reset_peak_memory_stats(9))):
    try:
        r[name] = "returned " + repr(call())[:40]
    except Exception as e:
        r[name] = type(e).__name__ + ": " + str(e).splitlines()[0]
print(json.dumps(r))
"""


@pytest.mark.parametrize("cxx", ["", "/nonexistent/c++"])  # the C++ stats hook, or Python's answer
def test_statistics_of_a_device_torch_lacks_raise_as_torch_npus_own(torch_npu: TorchNpu, tmp_path: Path,
                                                                   cxx: str) -> None:
    env = {"CXX": cxx, "NPU_POOL_CACHE": str(tmp_path / "cache")} if cxx else {}
    own, _ = torch_npu.results(DEVICE_ARGS.replace("INSTALL", "False"))
    pool, err = torch_npu.results(DEVICE_ARGS.replace("INSTALL", "True"), **env)
    assert own["count"] == pool["count"] == 2 and pool["ok"]
    for name in ("memory_stats(5)", "memory_allocated(-7)", "max_memory_reserved(9)"):
        assert "Invalid device argument" in own[name], own  # what torch_npu's own allocator says
        assert "Invalid device argument" in pool[name], (name, pool[name])
    assert "Invalid device argument" in pool["reset_peak_memory_stats(9)"]
    assert "Traceback" not in err


TORCH_FORK = """
import json, os, signal, threading, time, torch, torch_npu
import npu_pool
pools = npu_pool.install()
stop = threading.Event()
started = threading.Barrier(3)  # each thread has allocated once before the first fork
def churn():
    first = True
    while not stop.is_set():
        x = torch.empty(1 << 20, dtype=torch.uint8, device="npu")
        del x
        torch.npu.memory_allocated()
        if first:
            started.wait(30)
            first = False
threads = [threading.Thread(target=churn) for _ in range(2)]
for t in threads:
    t.start()
started.wait(30)
statuses = []
for i in range(8):
    time.sleep(0.01)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        signal.alarm(10)
        os.close(r)
        st = pools[0].stats()
        try:
            pools[0].malloc(4096)
            refused = "served"
        except npu_pool.PoolError as e:
            refused = str(e)
        os.write(w, json.dumps({"reserved": st["total"]["reserved"]["current"], "malloc": refused}).encode())
        os._exit(0)
    os.close(w)
    child = os.read(r, 4096).decode()
    os.close(r)
    statuses.append([os.waitpid(pid, 0)[1], child])
stop.set()
for t in threads:
    t.join()
import sys
sys.modules["npu_pool.install"]._reset()  # the device table closed under torch: a refusal, not an OOM
try:
    torch.empty(1 << 20, dtype=torch.uint8, device="npu")
    after = "served"
except Exception as e:
    after = type(e).__name__ + ": " + str(e).splitlines()[0]
print(json.dumps({"children": statuses, "after_close": after}))
"""


def test_fork_under_torch_npu_while_threads_allocate(torch_npu: TorchNpu) -> None:
    """Under the real torch_npu a forked child reads the parent's pool statistics without hanging,
    and is refused (clearly) device memory from the parent's pool. Then the device table is shut
    down under torch: a request is refused with a RuntimeError, not taken for an OOM."""
    out, err = torch_npu.results(TORCH_FORK)
    for status, child in out["children"]:
        assert status == 0, child
        got = json.loads(child)
        assert got["reserved"] > 0 and "fork of the one that made this pool" in got["malloc"]
    # the C++ malloc hook raises torch.OutOfMemoryError only for a lack of memory
    assert out["after_close"].startswith("RuntimeError: npu_pool: ") and "not configured" in out["after_close"]


def test_fifo_named_like_a_rank_report_is_refused(tmp_path) -> None:
    from npu_pool.recorder import report

    os.mkfifo(tmp_path / report.FILE_PATTERN.replace("*", "0"))
    with pytest.raises(ValueError, match="not a regular file"):
        report.load(tmp_path)


HOOKS_USED = """
import json, mindspeed_patch, torch, torch_npu
from npu_pool.install import _current, installed
x = torch.empty(1 << 20, dtype=torch.uint8, device="npu")
print(json.dumps({"cpp": _current.cpp_hooks, "allocated": installed()[0].stats()["total"]["allocated"]["current"]}))
"""


@pytest.mark.slow  # one rebuild of the C++ hooks (about half a minute)
def test_truncated_hooks_library_in_the_cache_is_rebuilt_under_torch_npu(torch_npu: TorchNpu) -> None:
    """The SIGBUS of issue 21: a torch_npu_hooks-*.so cut short in NPU_POOL_CACHE is rebuilt,
    and the process runs on the C++ hooks."""
    out, _ = torch_npu.results(HOOKS_USED, MEMORY_FRAGMENTATION="1")  # built (or verified) in the session cache
    assert out["cpp"]
    (lib,) = torch_npu.cache.glob("torch_npu_hooks-*.so")
    whole = lib.read_bytes()
    lib.write_bytes(whole[: len(whole) // 4])
    out, err = torch_npu.results(HOOKS_USED, MEMORY_FRAGMENTATION="1")
    assert out["cpp"] and out["allocated"] >= 1 << 20 and "Traceback" not in err
    assert lib.stat().st_size == len(whole)
