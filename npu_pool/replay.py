"""Replay traces through allocator policies on the simulated device.

Every policy serves the same recorded alloc/free sequence; the C loop does the
work (no Python per event). Two figures per policy:

- peak reserved with room to spare (a 1 TiB simulated device);
- minimum capacity: the smallest device (at 2 MiB resolution) on which the
  whole trace completes, found by bisection, with the release-and-retry events
  the policy needed there. 2 MiB less fails; allocators are not monotonic, so a
  still smaller device may complete by chance (the torch model on
  llama7b-offload-infer: sizes 248 and 424 MiB below its minimum capacity do).
"""
from __future__ import annotations

import array
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Iterable, Iterator, Sequence

from ._core import ffi, lib
from . import vocab
from .config import show
from .pool import POLICIES, Pool, _check, _event_dicts
from .trace.format import OP_ALLOC, OP_INIT_ALLOC, OP_INIT_SEGMENT, OP_OOM, OP_SEG_FREE, OP_SEG_HINT, Trace, device_type, is_count
from .trace.stats import live_profile
from .units import fmt_bytes

UNLIMITED = 1 << 40           # simulated device for "room to spare" replays
CAPACITY_STEP = vocab.SIM_PAGE  # resolution of the minimum-capacity search: the simulated device's page
# What npu_pool learns lifetimes from: "markers" (phase markers only: what a device running
# the recorder sees; the default), "sites" (markers and the trace's own site ids), "oracle"
# (the profiler's categories), "none". Codes are the core's (NP_HINTS_*).
HINTS = {name: code for code, name in enumerate(vocab.HINTS)}


class TraceTooLarge(ValueError):
    """A trace holds more than the simulated device of a room-to-spare replay (``UNLIMITED``)."""


@dataclass
class RunResult:
    """One replay of one trace through one policy on one device size."""

    ok: bool
    fail_index: int
    ops: int
    ns: int
    peak_live_bytes: int
    peak_reserved_bytes: int
    device_mallocs: int
    retries: int
    same_addr: int
    compared: int
    stats: dict[str, Any]
    recorded_ooms: int = 0      # requests the recorded run could not serve (OP_OOM events) ...
    ooms_served: int = 0        # ... and how many of them this policy served (probe_ooms)
    history: Sequence[dict[str, Any]] | None = None  # with history=True: the core's events (as Pool.history) ...
    blocks: list[dict[str, Any]] | None = None    # ... and the end state: Pool.blocks() ...
    ranges: list[tuple[int, int]] | None = None   # ... and Pool.mapped_ranges()
    calls: dict[str, int] | None = None           # device calls by kind made by the replay (vocab.CALL_NAMES)
    iteration_calls: list[dict[str, int]] | None = None  # with bounds: the calls of each stretch (see run) ...
    iteration_peaks: list[int] | None = None  # ... and the peak of live bytes requested in each


@dataclass
class PolicyResult:
    """The figures `npu-pool replay --json` writes (exactly these keys)."""

    trace: str
    policy: str
    peak_live_bytes: int
    peak_reserved_bytes: int
    utilization: float
    min_capacity_bytes: int | None
    retries_at_min_capacity: int | None
    device_mallocs: int
    ops: int
    ns_per_op: float
    stats_at_min_capacity: dict[str, Any] | None = None  # the pool's stats() there (not in JSON)
    calls: dict[str, int] | None = None                   # device calls by kind, given room to spare
    calls_at_min_capacity: dict[str, int] | None = None   # ... and at the minimum capacity
    iteration_calls: list[dict[str, int]] | None = None   # room to spare, per stretch of iteration_bounds (None: no repeats)
    iteration_peak_live: list[int] | None = None          # ... and each stretch's peak of live bytes

    JSON_KEYS: ClassVar[tuple[str, ...]] = ("trace", "policy", "peak_live_bytes", "peak_reserved_bytes", "utilization", "min_capacity_bytes",
                 "retries_at_min_capacity", "device_mallocs", "ops", "ns_per_op", "calls", "calls_at_min_capacity",
                 "iteration_calls", "iteration_peak_live")

    @property
    def trims_at_min_capacity(self) -> int | None:
        """npu_pool: pages moved without a synchronisation at the minimum capacity."""
        return None if self.stats_at_min_capacity is None else self.stats_at_min_capacity["trims"]

    @property
    def steady_calls(self) -> int | None:
        """Device calls in the steady iterations, given room to spare (None: no repeats, or none
        steady); see :func:`steady_calls`."""
        return steady_calls(self.iteration_calls, self.iteration_peak_live)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {k: d[k] for k in self.JSON_KEYS}


def iteration_bounds(trace: Trace) -> list[int]:
    """Event indices where iterations start: the ``MARK_ITER_BEGIN`` markers; without them the
    first allocation and the event after each ``MARK_OPTIMIZER_END`` (a recording whose only
    markers are the optimizer's, as torch's own annotations give); without those the first
    allocation and the repeats of the loop body the planner finds after its prologue
    (``planner.find_window``); [] when the trace does not repeat. So the stretch before the second
    bound is the first iteration with whatever set-up precedes it, and those after it repeat."""
    marks = [i for i, (op, cat) in enumerate(zip(trace.op, trace.cat)) if op == vocab.OP_MARK and cat == vocab.MARK_ITER_BEGIN]
    if len(marks) >= 2:
        return marks
    first = next((i for i, op in enumerate(trace.op) if op in (vocab.OP_ALLOC, vocab.OP_INIT_ALLOC)), None)
    if first is None:  # nothing allocated: nothing repeats
        return []
    ends = [i + 1 for i, (op, cat) in enumerate(zip(trace.op, trace.cat))
            if op == vocab.OP_MARK and cat == vocab.MARK_OPTIMIZER_END and first < i + 1 < len(trace)]
    if len(ends) >= 2:
        return [first] + ends
    if vocab.OP_ALLOC not in trace.op:  # only what was live before the recording: no loop body
        return []
    from .planner.iteration import find_window

    w = find_window(trace)
    period = w.end - w.body  # the loop body, after the prologue the window may start with
    if w.method != "period" or period <= 0:
        return []
    return ([w.start] if w.start < w.body else []) + list(range(w.body, len(trace), period))


def iterations_end(trace: Trace, bounds: Sequence[int]) -> int | None:
    """Where the last of the iterations ``bounds`` start ends, when the trace says so and events
    follow: the event after its last ``MARK_ITER_END`` from the last bound on (captures and the
    recorder mark each iteration's end; whatever gave the bounds: markers, optimizer steps, a
    period); None otherwise (the last stretch then runs to the end). What follows (teardown:
    frees, a final ``empty_cache``) is no iteration."""
    if not bounds:
        return None
    end = next((i + 1 for i in range(len(trace) - 1, bounds[-1] - 1, -1)
                if trace.op[i] == vocab.OP_MARK and trace.cat[i] == vocab.MARK_ITER_END), None)
    return end if end is not None and end < len(trace) else None


def steady_stretches(peaks: Sequence[int]) -> list[bool]:
    """Which stretches over :func:`iteration_bounds` are steady iterations, from each one's peak of
    live bytes: every iteration after the first (the third stretch on: before the first bound, the
    first iteration, then the repeats) that needs no more live memory than some stretch before it
    (the set-up before the first bound included).
    An iteration that raises the trace's live peak is not steady: its tensors need memory no
    earlier one held (the second of a training run whose optimizer makes its states at the first
    step's end, as torch's Adam does), which no allocator holding only what was live can have."""
    out, high = [], 0
    for k, p in enumerate(peaks):
        out.append(k >= 2 and p <= high)
        high = max(high, p)
    return out


def steady_calls(iteration_calls: list[dict[str, int]] | None, peaks: Sequence[int] | None) -> int | None:
    """Calls of every kind in the steady iterations (:func:`steady_stretches`), from per-stretch
    calls and live peaks over :func:`iteration_bounds`; None without them or when no iteration is
    steady (each one needs more live memory than all before it: a leak, a growing sequence)."""
    if iteration_calls is None or peaks is None:
        return None
    steady = steady_stretches(peaks)
    return sum(sum(d.values()) for d, s in zip(iteration_calls, steady) if s) if any(steady) else None


def split_calls(before: dict[str, int], snaps: list[dict[str, int]], after: dict[str, int]) -> list[dict[str, int]]:
    """Calls of each stretch between consecutive snapshots: before the first bound (set-up and
    whatever precedes the first iteration), each iteration, and the last one up to the end."""
    points = [before, *snaps, after]
    return [{k: b[k] - a[k] for k in a} for a, b in zip(points, points[1:])]


def run(trace: Trace, policy: str, capacity: int = UNLIMITED, *, fidelity: bool = False, hints: str = "markers",
        placed: "array.array | None" = None, classes: "array.array | None" = None, plan: Any = None,
        history: bool = False, device: str | None = None, bounds: "list[int] | None" = None,
        name: str | None = None, probe_ooms: bool = False, **pool_kwargs: Any) -> RunResult:
    """Replay ``trace`` once through a fresh pool of ``policy`` on a ``capacity``-byte device.

    ``placed``, if given, is an ``array("Q")`` as long as the trace; it receives the
    address each allocation event got (0 for other events); ``classes``, an
    ``array("B")``, the lifetime class (1 long, 2 short) each allocation was placed as.
    ``plan`` (a ``npu_pool.planner.Plan`` or plan file) is installed on a ``"planned"`` pool;
    its counters land in ``stats["plan"]``. ``history``: record every event in the pool's
    history (stamped with its trace event's index) and return it with the end state.
    ``bounds`` (increasing event indices, e.g. :func:`iteration_bounds`): ``iteration_calls`` gets
    the device calls made before the first bound, between each bound and the next, and after the
    last up to the end of the last iteration (:func:`iterations_end`; the calls after it, teardown,
    are in ``calls`` only) (len(bounds) + 1 dicts; a run that failed, those of the stretches up to
    its failure), ``iteration_peaks`` each stretch's peak of requested live bytes (a run that
    failed: None). ``probe_ooms``: try each request the recorded run could not serve (an
    ``OP_OOM`` event; freed again at once) and count those served (``ooms_served``), a question
    for the recorded run's memory (:func:`recorded_capacity`); by default they are passed over,
    as nobody served them: no figure counts them, as peak live never does."""
    if not isinstance(trace, Trace):  # (a path: npu_pool.trace.files.open_traces reads one)
        raise TypeError(f"run replays a Trace, not {type(trace).__name__}; open a file with "
                        "npu_pool.trace.files.open_traces")
    if hints not in HINTS:
        raise ValueError(f"unknown hints {hints!r}; choose one of {', '.join(HINTS)}")
    if plan is not None:
        from .planner.runtime import as_plan, check_made_for

        plan = as_plan(plan)
    pool_kwargs.setdefault("rules", device_type(trace, device))
    if plan is not None:
        check_made_for(plan, trace, name or str(trace.meta.get("origin") or "the replayed trace"), pool_kwargs["rules"])
    trace.validate(str(trace.meta.get("origin") or "trace"))
    with Pool(policy, capacity=capacity, **pool_kwargs) as pool:
        if plan is not None:
            from .planner.runtime import install

            install(pool, plan)
        if history:
            pool.set_history(vocab.HISTORY_MAX)  # the core's bound; memory is used only as events come
        inp, keep = trace.c_columns()  # the buffers must outlive the call
        inp.fidelity = int(fidelity)
        inp.hints = HINTS[hints]
        inp.probe_ooms = int(probe_ooms)
        if placed is not None:
            if len(placed) != len(trace) or placed.typecode != "Q":
                raise ValueError("placed must be an array('Q') with one entry per event")
            keep.append(ffi.from_buffer("uint64_t[]", placed))
            inp.placed = keep[-1]
        if classes is not None:
            if len(classes) != len(trace) or classes.typecode != "B":
                raise ValueError("classes must be an array('B') with one entry per event")
            keep.append(ffi.from_buffer("uint8_t[]", classes))
            inp.classes = keep[-1]
        if bounds:
            if any(b < a for a, b in zip(bounds, bounds[1:])) or bounds[0] < 0 or bounds[-1] >= len(trace):
                raise ValueError(f"bounds must be increasing indices of the trace's {len(trace)} events")
            tail = iterations_end(trace, bounds)  # (the stretch from it on, teardown, is dropped below)
            cuts = [*bounds, tail] if tail is not None else list(bounds)
            keep.append(ffi.new("uint64_t[]", cuts))
            inp.bounds = keep[-1]
            inp.n_bounds = len(cuts)
            keep.append(ffi.new("uint64_t[]", len(cuts) * lib.NP_CALL_COUNT))
            inp.bound_calls = keep[-1]
            keep.append(ffi.new("uint64_t[]", len(cuts) + 1))
            inp.bound_peaks = keep[-1]
        start = pool.stats()["calls"]  # what creating the device asked
        out = ffi.new("np_replay_out *")
        _check(lib.np_replay(pool.ctx, inp, out))
        st = pool.stats()
        calls = {k: st["calls"][k] - start[k] for k in start}
        iteration_calls = iteration_peaks = None
        if bounds:  # (a run that failed reached the bounds up to its failure: the stretches it entered)
            reached = len(cuts) if out.ok else sum(1 for b in cuts if b <= out.fail_index)
            if out.ok:  # (the stretch a run failed in has no peak: its request was not served)
                iteration_peaks = [int(x) for x in inp.bound_peaks[0:reached + 1]][:len(bounds) + 1]
            snaps = [{name: int(inp.bound_calls[i * lib.NP_CALL_COUNT + k]) - start[name]
                      for k, name in enumerate(vocab.CALL_NAMES)} for i in range(reached)]
            iteration_calls = split_calls({k: 0 for k in start}, snaps, calls)[:len(bounds) + 1]
        if plan is not None:
            st["plan"] = pool.plan_counts()
        end = (_EventLog(pool, len(trace)), pool.blocks(), pool.mapped_ranges()) if history else (None, None, None)
    return RunResult(ok=bool(out.ok), fail_index=int(out.fail_index), ops=int(out.ops), ns=int(out.ns),
                     peak_live_bytes=int(out.peak_live), peak_reserved_bytes=st["total"]["reserved"]["peak"],
                     device_mallocs=st["device_mallocs"], retries=st["retries"], same_addr=int(out.same_addr),
                     compared=int(out.compared), stats=st, recorded_ooms=int(out.recorded_ooms),
                     ooms_served=int(out.ooms_served), history=end[0], blocks=end[1], ranges=end[2],
                     calls=calls, iteration_calls=iteration_calls, iteration_peaks=iteration_peaks)


class _EventLog(Sequence):
    """A pool's whole history as :meth:`Pool.history` gives it, kept as the core's compact
    records (64 bytes an event); each event becomes a dict only when read, so a long replay's
    history costs no more than its records."""

    def __init__(self, pool: Pool, expected: int) -> None:
        cap = max(2 * expected + 1024, 1024)  # most events of a replay are one trace event each
        n = ffi.new("size_t *")
        while True:
            buf = ffi.new("np_event_info[]", cap)
            _check(lib.np_history(pool.ctx, buf, cap, n))
            if n[0] < cap:
                break
            cap *= 2
        self._buf, self._n = buf, int(n[0])

    def __len__(self) -> int:
        return self._n

    _CHUNK = 4096  # records turned into dicts at a time while iterating

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            start, stop, step = i.indices(self._n)
            if step != 1:
                return [self[j] for j in range(start, stop, step)]
            return _event_dicts(self._buf + start, max(0, stop - start), vocab.EVENT_NAMES)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("history index out of range")
        return _event_dicts(self._buf + i, 1, vocab.EVENT_NAMES)[0]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for start in range(0, self._n, self._CHUNK):
            yield from _event_dicts(self._buf + start, min(self._CHUNK, self._n - start), vocab.EVENT_NAMES)


def _as_plan(plan: Any) -> Any:
    """A plan file read once (replays repeat), a Plan or None as given."""
    if plan is None:
        return None
    from .planner.runtime import as_plan

    return as_plan(plan)


def min_capacity(trace: Trace, policy: str, *, hints: str = "markers", lo: int | None = None,
                 hi: int | None = None, no_retries: bool = False, plan: Any = None,
                 device: str | None = None, compact: bool = False) -> tuple[int, RunResult]:
    """Smallest device size (multiple of CAPACITY_STEP) on which the trace completes, by bisection
    (one step less fails; a still smaller size may complete: allocators are not monotonic), and that run.

    With ``no_retries`` the run must also need no release-and-retry event; ``compact``: pools that
    compact (:meth:`Pool.set_compaction`)."""
    plan = _as_plan(plan)
    lo = live_profile(trace).peak_bytes if lo is None else lo

    def play(capacity: int = UNLIMITED) -> RunResult:
        return run(trace, policy, capacity, hints=hints, plan=plan, device=device, compact=compact)

    if hi is None:
        hi = play().peak_reserved_bytes

    def fits(r: RunResult) -> bool:
        return r.ok and (r.retries == 0 or not no_retries)

    step = CAPACITY_STEP
    k_lo, k_hi = max(1, -(-lo // step)), max(1, -(-hi // step))
    best = play(k_hi * step)
    while not fits(best):  # a capped device may behave differently from the unlimited one
        k_lo, k_hi = k_hi + 1, k_hi * 2
        best = play(k_hi * step)
    while k_lo < k_hi:
        mid = (k_lo + k_hi) // 2
        r = play(mid * step)
        if fits(r):
            k_hi, best = mid, r
        else:
            k_lo = mid + 1
    return k_hi * step, best


# The most iterations evaluate() counts the calls of one by one (iteration_calls); past it, none.
MAX_ITERATIONS = 10_000


def too_large(trace: Trace, name: str, policy: str, r: RunResult) -> TraceTooLarge:
    """The error for a run of ``trace`` that failed on the (1 TiB) simulated device: the request it
    could not serve."""
    i = r.fail_index
    return TraceTooLarge(f"{name}: policy {policy} failed at event {i} (a request of {fmt_bytes(trace.size[i])} "
                         f"with {fmt_bytes(r.peak_live_bytes)} live at most before it) on the simulated "
                         "1 TiB device: the replay models one device of at most 1 TiB")


def past_the_device(asked: Trace, name: str) -> TraceTooLarge | None:
    """The error for a trace one of whose requests (``asked``: as the device's rules round them)
    is larger than the simulated device, before any replay; None when none is."""
    requests = (OP_ALLOC, OP_INIT_ALLOC)
    i = next((i for i, (op, size) in enumerate(zip(asked.op, asked.size)) if op in requests and size > UNLIMITED), None)
    if i is None:
        return None
    return TraceTooLarge(f"{name}: event {i} is a request of {fmt_bytes(asked.size[i])}, more than the simulated "
                         "1 TiB device: the replay models one device of at most 1 TiB")


def evaluate(trace: Trace, name: str, policy: str, *, hints: str = "markers", with_min_capacity: bool = True,
             plan: Any = None, device: str | None = None, bounds: list[int] | None = None,
             compact: bool = False) -> PolicyResult:
    """All figures of one trace under one policy (``plan``: for the ``"planned"`` policy;
    ``device``: whose request rules apply, default the trace's own); with ``bounds`` (the trace's
    :func:`iteration_bounds`, found once for all its policies: finding them can take far longer
    than a replay), the calls per iteration too, up to MAX_ITERATIONS iterations; ``compact``: a pool that
    compacts (:meth:`Pool.set_compaction`)."""
    plan = _as_plan(plan)
    if bounds and len(bounds) > MAX_ITERATIONS:  # (a file of markers would cost a table of calls per marker)
        bounds = None
    free_run = run(trace, policy, hints=hints, plan=plan, device=device, name=name,  # a wrong plan: named by file
                   bounds=bounds or None, compact=compact)
    if not free_run.ok:
        raise too_large(trace, name, policy, free_run)
    cap = retries = cap_stats = cap_calls = None
    if with_min_capacity:
        cap, at_cap = min_capacity(trace, policy, hints=hints, lo=free_run.peak_live_bytes,
                                   hi=free_run.peak_reserved_bytes, plan=plan, device=device, compact=compact)
        retries, cap_stats, cap_calls = at_cap.retries, at_cap.stats, at_cap.calls
    reserved = free_run.peak_reserved_bytes
    return PolicyResult(trace=name, policy=policy, peak_live_bytes=free_run.peak_live_bytes,
                        peak_reserved_bytes=reserved,
                        utilization=free_run.peak_live_bytes / reserved if reserved else 1.0,
                        min_capacity_bytes=cap, retries_at_min_capacity=retries,
                        device_mallocs=free_run.device_mallocs, ops=free_run.ops,
                        ns_per_op=free_run.ns / free_run.ops if free_run.ops else 0.0,
                        stats_at_min_capacity=cap_stats, calls=free_run.calls, calls_at_min_capacity=cap_calls,
                        iteration_calls=free_run.iteration_calls, iteration_peak_live=free_run.iteration_peaks)


@dataclass
class Fidelity:
    """How closely the torch model reproduces a recorded run."""

    trace: str
    recorded_peak_reserved: int
    simulated_peak_reserved: int
    recorded_segment_allocs: int
    simulated_segment_allocs: int
    same_place: float          # share of window allocations at their recorded address
    compared: int

    @property
    def reserved_error(self) -> float:
        r = self.recorded_peak_reserved
        return abs(self.simulated_peak_reserved - r) / r if r else 0.0

    @property
    def segments_error(self) -> float:
        r = self.recorded_segment_allocs
        return abs(self.simulated_segment_allocs - r) / r if r else float(self.simulated_segment_allocs != 0)

    @property
    def passed(self) -> bool:
        return self.reserved_error <= 0.01 and self.segments_error <= 0.02


def validate(trace: Trace, name: str) -> Fidelity:
    """Replay with the torch model from the recorded state and compare with what was recorded."""
    if trace.meta.get("expandable_segments"):
        settings = trace.meta.get("allocator_settings")
        policy = settings.get("npu_pool_policy") if isinstance(settings, dict) else None
        what = f"npu_pool's {show(policy, 40)} policy" if isinstance(policy, str) else "expandable segments"
        raise ValueError(f"{name}: recorded with {what}; --validate models PyTorch's classic allocator only")
    rec = trace.meta.get("recorded")
    if not rec:
        raise ValueError(f"{name}: the trace carries no recorded figures (import it from a PyTorch snapshot)")
    if not isinstance(rec, dict) or not all(is_count(rec.get(k)) for k in ("peak_reserved_bytes", "segment_allocs")):
        raise ValueError(f"{name}: the trace's meta['recorded'] is malformed (it needs whole numbers "
                         "peak_reserved_bytes and segment_allocs)")
    r = run(trace, "torch", fidelity=True, hints="none")
    if not r.ok:
        raise too_large(trace, name, "torch", r)
    primed = sum(1 for op in trace.op if op == OP_INIT_SEGMENT)
    return Fidelity(trace=name, recorded_peak_reserved=int(rec["peak_reserved_bytes"]),
                    simulated_peak_reserved=r.peak_reserved_bytes,
                    recorded_segment_allocs=int(rec["segment_allocs"]),
                    simulated_segment_allocs=r.device_mallocs - primed,
                    same_place=r.same_addr / r.compared if r.compared else 1.0, compared=r.compared)


def recorded_ooms(trace: Trace) -> list[dict[str, int]]:
    """The recorded run's failed requests (``meta["ooms"]``: event, size, device_free), checked:
    a ValueError (TraceError) names a malformed list instead of a failure somewhere later."""
    return trace.ooms()


def recorded_capacity(trace: Trace) -> int | None:
    """The device memory the recorded run had when a request failed (an ``OP_OOM`` event): what
    its allocator held (segments) plus what the device still reported free; the largest over its
    failures. None when nothing failed in the recording."""
    ooms = {o["event"]: o["device_free"] for o in recorded_ooms(trace)}
    if not ooms:
        return None
    reserved = best = 0
    for i, (op, size) in enumerate(zip(trace.op, trace.size)):
        if op in (OP_INIT_SEGMENT, OP_SEG_HINT):
            reserved += size
        elif op == OP_SEG_FREE:
            reserved -= size
        elif op == OP_OOM and i in ooms:
            best = max(best, reserved + ooms[i])
    return best or None


# What a command that replays without planning says to a "planned" (replay plans the trace first).
NEEDS_PLAN = ("the planned policy needs a plan made from the trace: `npu-pool replay TRACE --policy planned` "
              "plans and replays it (`npu-pool plan` writes one); without a plan it is the npu_pool policy")


def policies_from(spec: str | Iterable[str], *, planned: bool = True) -> list[str]:
    """Parse "torch,npu_pool" (or a list) into known policy names (``planned``: "planned" among them)."""
    names = [p.strip() for p in spec.split(",")] if isinstance(spec, str) else list(spec)
    known = [p for p in POLICIES if planned or p != "planned"]
    if "" in names:  # ("torch," or ",npu_pool")
        raise ValueError(f"the policy list {','.join(names)!r} has an empty name; choose from {', '.join(known)}")
    bad = [p for p in names if p not in POLICIES]
    if bad or not names:
        raise ValueError(f"unknown policy {', '.join(bad) or '(none)'}; choose from {', '.join(known)}")
    if not planned and "planned" in names:
        raise ValueError(NEEDS_PLAN)
    twice = sorted({p for p in names if names.count(p) > 1})
    if twice:  # (a second row of the same figures, or a policy meant and mistyped as another)
        raise ValueError(f"the policy list {','.join(names)!r} names {', '.join(twice)} twice")
    return names


__all__ = ["run", "iteration_bounds", "iterations_end", "steady_stretches", "steady_calls", "split_calls", "min_capacity", "evaluate", "validate", "policies_from", "recorded_capacity", "RunResult",
           "PolicyResult", "Fidelity", "TraceTooLarge", "too_large", "past_the_device", "recorded_ooms", "OP_ALLOC"]
