"""Live replay: a trace's allocations as real tensors, in trace order, on this machine's device.

Each allocation event becomes ``torch.empty(size, dtype=uint8)`` on the device (torch_npu's
``npu``, or CUDA), each free drops that tensor, ``empty_cache`` events call the framework's
``empty_cache``, phase markers reach npu_pool's pool, and a colocated trace's regions, pauses
and resumes are played as the simulator plays them (npu_pool's tags; under the native allocator,
explicit offload: a pause drops the tag's tensors and empties the cache, a resume makes them
again); nothing else runs. The trace is played once under the framework's own caching allocator
(``native``) and once under npu_pool, each in a process of its own (a process chooses its
allocator once), with the allocators' defaults (the caller's ``MEMORY_FRAGMENTATION``, npu_pool
settings, torch allocator settings and OOM-snapshot settings are left out of its environment;
``compact`` turns npu_pool's compaction on, docs/api.md). Each process reports peak
reserved and allocated bytes (the framework's ``max_memory_*``), the device calls the
framework counts (``num_device_alloc`` / ``num_device_free``), the vendor runtime's own
per-function call counts where the runtime exposes them (the tests' fake CANN does:
``fake_calls``), the replay's wall time and, on request, the minimum capacity: the smallest
memory fraction (in 2 MiB steps of the device) under which the whole trace still runs, found
by bisection inside the same process.

``npu-pool replay TRACE --live [--validate]`` is the command; :func:`replay_live` the API;
``python -m npu_pool.live`` the worker each process runs.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from . import alloc_conf, config, oom
from .units import name_width
from .vocab import CALL_VENDOR
from .trace.format import (OP_ALLOC, OP_EMPTY_CACHE, OP_FREE, OP_INIT_ALLOC, OP_MARK, OP_PAUSE, OP_REGION,
                           OP_RESUME, Trace)

ALLOCATORS = ("native", "npu_pool")
STEP = 2 << 20  # resolution of the minimum-capacity search, as in the simulator's
# The vendor calls reported when the runtime counts them (the fake runtimes of tests/fake_vendor):
# the device-memory calls of the core's vocabulary (what npu_pool's stats count by kind, so a live
# run and its simulation compare kind by kind), the device synchronisation, the current device's
# lookup, and the calls that order memory between streams (events and stream queries).
MEMORY_KINDS = ("malloc", "free", "reserve", "release", "phys_create", "phys_release", "map", "unmap", "sync_device")
COUNTED_KINDS = MEMORY_KINDS + ("get_device", "event_create", "event_record", "event_wait", "event_destroy",
                                "stream_query")
VENDOR_CALLS = {device: tuple(CALL_VENDOR[vendor][k] for k in COUNTED_KINDS)
                for device, vendor in (("npu", "acl"), ("cuda", "cuda"))}
# Of those, the calls that take device memory: one per segment, or one per mapped chunk.
ALLOC_CALLS = {"npu": ("aclrtMalloc", "aclrtMapMem"), "cuda": ("cudaMalloc", "cuMemMap")}
_RUNTIME_LIB = {"npu": "libascendcl.so", "cuda": "libcudart.so"}
# The caller's settings a worker leaves out, so that each runs the allocator its row names, with
# its defaults: the switch and npu_pool's settings (its start-up hook would install npu_pool in
# the native worker too), torch's allocator settings (the simulator models the defaults), and
# out-of-memory snapshots (the minimum-capacity search fails requests on purpose).
_CALLER_SETTINGS = (config.ENABLE, config.FRACTION, config.POLICY, config.PLAN, config.COMPACT, config.CONFIG_FILE,
                    oom.ENV, oom.ENABLE, oom.PATH, *alloc_conf.VARIABLES,
                    # (torch's and torch_npu's switches no npu_pool module reads)
                    "PYTORCH_NO_NPU_MEMORY_CACHING", "PYTORCH_NO_CUDA_MEMORY_CACHING", "MULTI_STREAM_MEMORY_REUSE")


class LiveError(RuntimeError):
    """A live replay could not run (no device, the framework failed); the message says why."""


@dataclass
class LiveResult:
    """One trace played live under one allocator."""

    trace: str
    allocator: str                 # "native" (the framework's caching allocator) or "npu_pool"
    device: str                    # "npu" or "cuda"
    ok: bool                       # every request was served (with room to spare)
    fail_index: Optional[int]      # the event that failed when not ok
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    min_capacity_bytes: Optional[int]
    device_allocs: Optional[int]   # the framework's num_device_alloc / num_device_free
    device_frees: Optional[int]
    vendor_calls: Optional[dict[str, int]]  # per vendor function (runtimes that count them)
    seconds: float                 # wall time of one replay (the room-to-spare one)
    pool_calls: Optional[dict[str, int]] = None  # npu_pool's own device calls by kind (its run only)
    device_bytes: Optional[int] = None  # the device's free memory when the replay began (mem_get_info)
    compact: bool = False          # npu_pool with compaction (docs/api.md)
    compactions: Optional[int] = None  # npu_pool's compactions in the replay (its run only)

    @property
    def label(self) -> str:
        """The allocator as the tables name it: ``compacting`` for npu_pool with compaction."""
        return "compacting" if self.compact else self.allocator

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def vendor_allocs(self) -> Optional[int]:
        """Vendor calls that took device memory (segments, or mapped pages), where counted."""
        if self.vendor_calls is None:
            return None
        return sum(self.vendor_calls.get(n, 0) for n in ALLOC_CALLS[self.device])


# ---- the parent: one process per allocator -------------------------------------------------

_WORKER_SAYS = "npu-pool replay --live: "  # how a worker's LiveError starts on its stderr (exit 2)


def replay_live(trace: Trace, name: str, *, device: Optional[str] = None, allocators: Sequence[str] = ALLOCATORS,
                min_capacity: bool = False, python: Optional[str] = None, timeout: float = 3600.0,
                env: Optional[dict[str, str]] = None, compact: bool = False) -> list[LiveResult]:
    """Play ``trace`` live under each allocator, each in a fresh process of ``python`` (default this
    interpreter); ``device``: ``"npu"``, ``"cuda"`` or None (an NPU if torch_npu has one, else CUDA);
    ``compact``: npu_pool with compaction."""
    if device not in (None, "npu", "cuda"):
        raise ValueError(f"unknown device {device!r}; choose npu or cuda")
    bad = [a for a in allocators if a not in ALLOCATORS]
    if bad or not allocators:
        raise ValueError(f"unknown allocator {', '.join(bad) or '(none)'}; choose from {', '.join(ALLOCATORS)}")
    out = []
    if env is None:
        env = {k: v for k, v in os.environ.items() if k not in _CALLER_SETTINGS}
    with _Workers() as workers, tempfile.TemporaryDirectory(prefix="npu_pool_live_") as d:
        path = Path(d) / "trace.npt"
        trace.save(path)
        for allocator in allocators:
            cmd = [python or sys.executable, "-m", "npu_pool.live", str(path), "--allocator", allocator,
                   "--device", device or "auto"] + (["--min-capacity"] if min_capacity else [])
            cmd += ["--compact"] if compact and allocator == "npu_pool" else []
            try:
                r = workers.run(cmd, timeout=timeout, env=env)
            except subprocess.TimeoutExpired:
                raise LiveError(f"{name}: the live replay under {allocator} ran past {timeout:.0f} s") from None
            if r is None:  # SIGTERM: the folder goes, then the process ends of it (_Workers)
                break
            lines = r.stdout.strip().splitlines()
            if r.returncode or not lines:
                why = (r.stderr.strip().splitlines() or ["(no message)"])[-1]
                if r.returncode == 2 and why.startswith(_WORKER_SAYS):  # its own reason (no device): that alone
                    raise LiveError(f"{name}: {why[len(_WORKER_SAYS):]}")
                raise LiveError(f"{name}: the live replay under {allocator} failed (exit {r.returncode}): {why}")
            rec = json.loads(lines[-1])
            out.append(LiveResult(trace=name, **rec))
    return out


class _Workers:
    """Runs the workers, one at a time, so that SIGTERM leaves none behind. Its default action
    would end this process at once and leave the worker running (on a device: holding memory) and
    the temporary folder behind. Meanwhile a handler notes it and kills the worker running, or the
    one being started as soon as it has started; the caller stops, its folder goes, and on leaving
    the process dies of the signal as before. The handler raises nothing: an exception raised
    there could land inside ``subprocess.Popen`` between its fork and its return, leaving a child
    nobody kills (seen under load). Only from the main thread where nothing else handles SIGTERM
    (Python's rule; a handler of the caller's is left alone)."""

    def __init__(self) -> None:
        self.terminated = False
        self._running: Optional[subprocess.Popen] = None
        self._armed = False

    def __enter__(self) -> "_Workers":
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, self._on_sigterm)
            self._armed = True
        return self

    def _on_sigterm(self, _signum: int, _frame: Any) -> None:
        self.terminated = True
        if self._running is not None:
            self._running.kill()

    def run(self, cmd: list[str], timeout: float, env: dict[str, str]) -> Optional[subprocess.CompletedProcess]:
        """``cmd``'s exit status and output (text); None once SIGTERM has arrived. A worker past
        ``timeout`` seconds is killed (subprocess.TimeoutExpired)."""
        if self.terminated:
            return None
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as p:
            self._running = p
            try:
                if self.terminated:  # (it came while the worker started)
                    p.kill()
                out, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
                raise
            finally:
                self._running = None
        return None if self.terminated else subprocess.CompletedProcess(cmd, p.returncode, out, err)

    def __exit__(self, *_exc: Any) -> None:
        if self._armed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if self.terminated:
                os.kill(os.getpid(), signal.SIGTERM)


# ---- beside the simulation ------------------------------------------------------------------

SIMULATED = {"native": "torch", "npu_pool": "npu_pool"}  # the policy that models each allocator
GiB = float(1 << 30)
LEGEND = """\
Live replay on this machine's device: every allocation of the trace as a tensor, in trace order,
under the framework's own caching allocator (native) and under npu_pool, each in its own process
(compacting: npu_pool with compaction, --compact; --json has its compactions).
  peak rsvd / peak alloc  the framework's max_memory_reserved / max_memory_allocated (GiB)
  min cap     the smallest memory fraction (2 MiB steps of the device) under which the trace runs
  dev allocs  device allocations the framework counts (num_device_alloc: segments, or mapped ranges)
  vendor      the runtime's own count of the calls that took memory (aclrtMalloc + aclrtMapMem, or
              cudaMalloc + cuMemMap), where it keeps one (the tests' fake runtime); --json has each call
  seconds     wall time of one replay
With --validate each live row has the simulation's beside it (sim: the torch model for native,
the npu_pool policy for npu_pool learning from the phase markers, as the live pool does, with the
same device's rules, on a device of the memory the live one had free: on a GPU that others use
too, near its end the two may part); 'same' compares both peaks, the device allocations and the
minimum capacity (each where the live run has one), the compactions, and where a run ran out of
memory, the event. --policy and --hints do not apply to --live."""


def simulated(trace: Trace, r: LiveResult, with_min_capacity: bool = True) -> dict[str, Any]:
    """The simulator's figures for what ``r`` measured: the model of its allocator under the rules
    of its device, on a device of the memory the live one had free when the replay began,
    learning from the phase markers as the live pool does; ``same``: equal peaks (reserved and
    allocated), device allocations and minimum capacities (each where the live run has one), and
    the same event failing where the live run ran out of memory, and as many compactions."""
    from .replay import UNLIMITED, min_capacity, run

    policy = SIMULATED[r.allocator]
    sim = run(trace, policy, r.device_bytes or UNLIMITED, device=r.device, compact=r.compact)
    # (the live run's minimum capacity, where it found one: a trace it could not play has none)
    cap = (min_capacity(trace, policy, device=r.device, compact=r.compact)[0]
           if with_min_capacity and r.min_capacity_bytes else None)
    peak_allocated = sim.stats["total"]["allocated"]["peak"]
    same = (sim.peak_reserved_bytes == r.peak_reserved_bytes and peak_allocated == r.peak_allocated_bytes
            and (r.device_allocs is None or sim.device_mallocs == r.device_allocs)
            and (cap is None or r.min_capacity_bytes is None or cap == r.min_capacity_bytes)
            and sim.ok == r.ok and (r.ok or sim.fail_index == r.fail_index)
            and (r.compactions is None or sim.stats["compactions"] == r.compactions))
    return {"policy": policy, "device": r.device, "peak_reserved_bytes": sim.peak_reserved_bytes,
            "peak_allocated_bytes": peak_allocated, "min_capacity_bytes": cap,
            "device_mallocs": sim.device_mallocs, "device_frees": sim.stats["device_frees"],
            "seconds": sim.ns / 1e9, "same": same, "ok": sim.ok, "fail_index": None if sim.ok else sim.fail_index,
            "compactions": sim.stats["compactions"]}


def format_live(rows: Sequence[tuple[LiveResult, Optional[dict[str, Any]]]]) -> str:
    """The live figures (GiB), each followed by the simulation's when given: :data:`LEGEND`."""
    def gib(b: Optional[int]) -> str:
        return "-" if b is None else f"{b / GiB:.3f}"

    w = name_width(r.trace for r, _ in rows)
    head = (f"{'trace':{w}} {'allocator':10} {'where':5} {'peak rsvd':>9} {'peak alloc':>10} {'min cap':>9} "
            f"{'dev allocs':>10} {'vendor':>7} {'seconds':>8} {'same':>4}")
    lines = [head, "-" * len(head)]
    for r, sim in rows:
        vendor = "-" if r.vendor_allocs is None else str(r.vendor_allocs)
        devs = "-" if r.device_allocs is None else str(r.device_allocs)
        lines.append(f"{r.trace:{w}} {r.label:10} {'live':5} {gib(r.peak_reserved_bytes):>9} "
                     f"{gib(r.peak_allocated_bytes):>10} {gib(r.min_capacity_bytes):>9} {devs:>10} {vendor:>7} "
                     f"{r.seconds:8.3f} {'':>4}")
        if sim is not None:
            lines.append(f"{r.trace:{w}} {r.label:10} {'sim':5} {gib(sim['peak_reserved_bytes']):>9} "
                         f"{gib(sim['peak_allocated_bytes']):>10} {gib(sim['min_capacity_bytes']):>9} "
                         f"{sim['device_mallocs']:>10} {'-':>7} {sim['seconds']:8.3f} {'yes' if sim['same'] else 'NO':>4}")
    for r, sim in rows:
        if not r.ok:
            lines.append(f"{r.trace}: under {r.label} the device ran out of memory at event {r.fail_index}; "
                         "its figures are those up to there")
        if sim is not None and not sim["ok"]:
            lines.append(f"{r.trace}: simulated on a device of the {gib(r.device_bytes)} GiB it had free, "
                         f"{r.label} runs out of memory at event {sim['fail_index']}")
    return "\n".join(lines)


# ---- the worker: one allocator, in this process ------------------------------------------------

def _framework(device: str) -> tuple[str, Any, Any]:
    """(device type, torch, its device module) of the device asked for (auto: NPU first)."""
    import torch

    if device in ("npu", "auto"):
        try:
            import torch_npu  # noqa: F401  (registers torch.npu)
        except ImportError:
            if device == "npu":
                raise LiveError("--device npu: torch_npu is not installed in this Python") from None
        else:
            if torch.npu.is_available():
                return "npu", torch, torch.npu
            if device == "npu":
                raise LiveError("--device npu: torch_npu sees no NPU on this machine")
    if torch.cuda.is_available():
        return "cuda", torch, torch.cuda
    raise LiveError("no NPU (torch_npu) or CUDA GPU on this machine: a live replay needs the real device "
                    "(the simulator needs none: drop --live)")


def _vendor_counter(kind: str) -> Any:
    """The runtime's ``fake_calls(name)`` when the loaded runtime counts its calls, else None."""
    import ctypes

    try:
        lib = ctypes.CDLL(_RUNTIME_LIB[kind], mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL)
    except OSError:
        return None
    fn = getattr(lib, "fake_calls", None)
    if fn is None:
        return None
    fn.restype, fn.argtypes = ctypes.c_long, [ctypes.c_char_p]
    return lambda name: int(fn(name.encode()))


def is_oom(e: BaseException) -> bool:
    """An allocation refused for lack of memory: the framework's error, or (a pluggable allocator
    whose C malloc returned NULL, which torch does not check) a tensor without memory."""
    text = str(e).lower()
    return isinstance(e, MemoryError) or "out of memory" in text or "data is not allocated yet" in text


def cap_fraction(cap_bytes: int, total: int) -> float:
    """The memory fraction that caps an allocator of a ``total``-byte device at exactly ``cap_bytes``
    (1.0 where that is the whole device or more): allocators floor fraction * total, and half a byte
    survives float error."""
    return min(1.0, (cap_bytes + 0.5) / total)


class Player:
    """Plays one trace as tensors; replays repeat (minimum capacity) in the same process."""

    def __init__(self, trace: Trace, torch: Any, module: Any, kind: str, pool: Any):
        self.trace, self.torch, self.module, self.pool = trace, torch, module, pool
        self.dev = torch.device(kind, 0)
        self.streams: dict[int, Any] = {}
        self._total: Optional[int] = None  # the device's memory, asked once (cap)
        self._made: set[int] = set()  # tags whose region the pool has (a pause needs one)
        self._paused: set[int] = set()  # tags npu_pool holds paused

    def _tag_op(self, op: int, tag: int, backup: bool, live: list[Any], tag_of: list[int], off: dict[int, int],
                region: contextlib.ExitStack) -> None:
        """A region, pause or resume of the trace, as the simulator plays it (csrc/replay.c,
        tag_op): under npu_pool its tags ("tag<N>"); under the native allocator what a user of
        it does, explicit offload: a pause drops the tag's tensors and empties the cache, a
        resume makes them again. A resume the device cannot hold raises the framework's
        out-of-memory error."""
        name = f"tag{tag}"
        if op == OP_REGION:
            region.close()
            if tag >= 0 and self.pool is not None:
                region.enter_context(self.pool.region(name))
                self._made.add(tag)
        elif self.pool is not None:
            if op == OP_PAUSE:
                if tag not in self._made:  # a tag paused before any request in it: made, as the simulator does
                    with self.pool.region(name):
                        pass
                    self._made.add(tag)
                self.pool.pause(name, backup)
                self._paused.add(tag)
            else:
                from .pool import OutOfMemoryError

                try:
                    self.pool.resume(name)
                except OutOfMemoryError as e:  # (the same failure as a request's)
                    raise MemoryError(f"out of memory: {e}") from None
                self._paused.discard(tag)
        elif op == OP_PAUSE:
            for i, t in enumerate(tag_of):
                if t == tag and live[i] is not None:
                    off[i] = live[i].numel()
                    live[i] = None
            self.module.empty_cache()
        else:
            for i in [i for i in off if tag_of[i] == tag]:
                live[i] = self._alloc(off.pop(i), 0)

    def _stream(self, s: int) -> Any:
        if s not in self.streams:
            self.streams[s] = self.module.Stream(device=self.dev)
        return self.streams[s]

    def _alloc(self, size: int, stream: int) -> Any:
        torch = self.torch
        if stream == 0:
            t = torch.empty(size, dtype=torch.uint8, device=self.dev)
        else:
            with self.module.stream(self._stream(stream)):
                t = torch.empty(size, dtype=torch.uint8, device=self.dev)
        t.data_ptr()  # a NULL from a pluggable allocator's C malloc fails here, not at torch.empty
        return t

    def play(self, at: Sequence[int] = (), on_bound: Optional[Callable[[int], None]] = None) -> Optional[int]:
        """Replay every event; None when all were served, else the index of the one that failed.
        ``on_bound(k)`` is called before event ``at[k]`` (event indices in order, as
        ``replay.iteration_bounds`` gives; ValueError otherwise)."""
        t = self.trace
        op, cat, ids, size, stream = t.op, t.cat, t.id, t.size, t.stream
        if on_bound and (any(b < a for a, b in zip(at, at[1:])) or any(not 0 <= x < len(op) for x in at)):
            raise ValueError(f"bounds must be event indices in order, in 0..{len(op) - 1}")
        live: list[Any] = [None] * t.n_ids
        tag_of = [-1] * t.n_ids  # the tag of the region each allocation was made in
        off: dict[int, int] = {}  # id -> size, of a native run's tensors dropped at their tag's pause
        current = -1
        region = contextlib.ExitStack()
        failed = None
        k, nxt = 0, (at[0] if at and on_bound else -1)
        try:
            for i in range(len(op)):
                while i == nxt:  # (a bound given twice is called twice)
                    on_bound(k)  # type: ignore[misc]
                    k += 1
                    nxt = at[k] if k < len(at) else -1
                o = op[i]
                if o == OP_ALLOC or o == OP_INIT_ALLOC:
                    try:
                        live[ids[i]] = self._alloc(size[i], stream[i])
                    except (RuntimeError, MemoryError) as e:
                        if not is_oom(e):
                            raise
                        failed = i
                        break
                    tag_of[ids[i]] = current
                elif o == OP_FREE:
                    live[ids[i]] = None
                    off.pop(ids[i], None)
                elif o == OP_REGION or o == OP_PAUSE or o == OP_RESUME:
                    current = ids[i] if o == OP_REGION else current
                    try:
                        self._tag_op(o, ids[i], cat[i] != 0, live, tag_of, off, region)
                    except (RuntimeError, MemoryError) as e:
                        if not is_oom(e):
                            raise
                        failed = i
                        break
                elif o == OP_MARK:
                    if self.pool is not None:
                        self.pool.mark(cat[i], ids[i])
                elif o == OP_EMPTY_CACHE:
                    self.module.empty_cache()
                # (OP_OOM, a request the recorded run could not serve, is passed over, as the simulator
                # passes it over: nobody served it, so no figure counts it)
        finally:
            live.clear()
            region.close()
            while self._paused:  # each play starts with every tag running, as a new process's pool
                self.pool.resume(f"tag{self._paused.pop()}")  # (its tensors are gone: nothing to map)
            self.module.synchronize()
        return failed

    def total(self) -> int:
        """The device's memory (asked once)."""
        if self._total is None:
            self._total = int(self.module.mem_get_info(self.dev)[1])
        return self._total

    def cap(self, cap_bytes: Optional[int]) -> None:
        """Cap the framework's allocator at exactly ``cap_bytes`` (None: uncapped) through its memory
        fraction (:func:`cap_fraction`)."""
        fraction = 1.0 if cap_bytes is None else cap_fraction(cap_bytes, self.total())
        self.module.set_per_process_memory_fraction(fraction, self.dev)

    def reset(self) -> None:
        self.module.empty_cache()
        if self.pool is not None:  # each play as a first run, as the simulator's (a new process's pool)
            self.pool.forget()
        self.module.reset_peak_memory_stats(self.dev)


def _min_capacity(player: Player, lo: int, hi: int) -> Optional[int]:
    """Smallest multiple of STEP under which the trace runs, by bisecting the memory fraction."""
    total = player.total()

    def fits(k: int) -> bool:
        if k * STEP > total:
            return False
        player.cap(k * STEP)
        player.reset()
        ok = player.play() is None
        player.reset()
        return ok

    k_max = total // STEP
    k_lo = max(1, -(-lo // STEP))
    if k_lo > k_max:  # (the live bytes alone pass the device)
        return None
    k_hi = min(max(k_lo, -(-hi // STEP)), k_max)  # (reserved below the live bytes: no answer below them)
    while not fits(k_hi):  # a capped device may behave differently from the free one
        if k_hi >= k_max:  # (the whole device tried)
            player.cap(None)
            return None
        k_lo, k_hi = k_hi + 1, min(k_hi * 2, k_max)
    while k_lo < k_hi:
        mid = (k_lo + k_hi) // 2
        if fits(mid):
            k_hi = mid
        else:
            k_lo = mid + 1
    player.cap(None)
    return k_hi * STEP


def run_worker(path: str, allocator: str, device: str, min_capacity: bool, compact: bool = False) -> dict[str, Any]:
    """Play the trace at ``path`` under ``allocator`` in this process (npu_pool with compaction:
    ``compact``); the figures as a dict."""
    if compact and allocator != "npu_pool":
        raise LiveError(f"compaction is npu_pool's: the {allocator} allocator has none")
    trace = Trace.load(path)
    kind, torch, module = _framework(device)
    pool = None
    if allocator == "npu_pool":  # installed before the framework's own allocator serves anything
        from .install import install

        pool = install(kind).get(0)
        if compact:
            from .pool import PoolError

            try:
                pool.set_compaction(True)
            except PoolError as e:  # (a runtime that cannot copy device memory to the host)
                raise LiveError(f"--compact: {e}") from None
    module.set_device(0)
    player = Player(trace, torch, module, kind, pool)
    counter = _vendor_counter(kind)
    names = VENDOR_CALLS[kind]
    free0 = int(module.mem_get_info(player.dev)[0])  # (before the counters: its calls are not the play's)
    before = {n: counter(n) for n in names} if counter else {}
    stats0 = module.memory_stats(player.dev)
    module.reset_peak_memory_stats(player.dev)
    t0 = time.perf_counter()
    failed = player.play()
    seconds = time.perf_counter() - t0
    stats = module.memory_stats(player.dev)
    calls = {n: counter(n) - before[n] for n in names} if counter else None

    def delta(key: str) -> Optional[int]:
        return int(stats[key]) - int(stats0.get(key, 0)) if key in stats else None

    rec = dict(allocator=allocator, device=kind, ok=failed is None, fail_index=failed,
               peak_reserved_bytes=int(module.max_memory_reserved(player.dev)),
               peak_allocated_bytes=int(module.max_memory_allocated(player.dev)), min_capacity_bytes=None,
               device_allocs=delta("num_device_alloc"), device_frees=delta("num_device_free"), vendor_calls=calls,
               seconds=seconds, device_bytes=free0,
               pool_calls={k: int(v) for k, v in pool.stats()["calls"].items() if v} if pool is not None else None,
               compact=compact, compactions=int(pool.stats()["compactions"]) if pool is not None else None)
    if min_capacity and failed is None:
        from .trace.stats import live_profile

        player.reset()
        # from the trace's peak live bytes: the peak allocated counts a failed request of the recorded
        # run that this one could serve (room to spare), and the search must go below it
        rec["min_capacity_bytes"] = _min_capacity(player, live_profile(trace).peak_bytes,
                                                  rec["peak_reserved_bytes"])
    return rec


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m npu_pool.live", description="one live replay (the worker)")
    p.add_argument("trace", help="an .npt trace")
    p.add_argument("--allocator", choices=ALLOCATORS, default="native")
    p.add_argument("--device", choices=("auto", "npu", "cuda"), default="auto")
    p.add_argument("--min-capacity", action="store_true")
    p.add_argument("--compact", action="store_true", help="npu_pool with compaction")
    args = p.parse_args(argv)
    try:
        rec = run_worker(args.trace, args.allocator, args.device, args.min_capacity, args.compact)
    except LiveError as e:
        print(f"{_WORKER_SAYS}{e}", file=sys.stderr)
        return 2
    print(json.dumps(rec))
    return 0


__all__ = ["replay_live", "simulated", "format_live", "is_oom", "cap_fraction", "Player", "LiveResult", "LiveError", "ALLOCATORS",
           "MEMORY_KINDS", "COUNTED_KINDS", "VENDOR_CALLS", "ALLOC_CALLS", "SIMULATED", "LEGEND", "run_worker"]

if __name__ == "__main__":
    sys.exit(main())
