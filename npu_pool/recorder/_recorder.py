"""The :class:`Recorder`: phase markers to allocator pools (and to a running profiler)."""
from __future__ import annotations

import contextlib
import operator
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Union

from ..locks import ForkSafeLock
from ._marks import (END_OF, MARK_FORWARD_BEGIN, MARK_BACKWARD_BEGIN, MARK_ITER_BEGIN, MARK_ITER_END,
                     STAGE_OF, code_of, phase_codes, profiler_label)


_PER_ITERATION = ("forward", "backward", "optimizer")  # stages an iteration holds whole
# Markers come from several threads (torch's backward hooks run on its autograd threads): one
# lock for every recorder (a lock per recorder would register fork handlers per recorder)
_MARKING = ForkSafeLock()


@dataclass
class RecorderState:
    """Where the recorded program is: what the markers sent so far opened and closed."""

    stage: Optional[str] = None      # innermost open stage: setup, forward, backward, optimizer, eval
    iteration: int = -1              # current (or last) iteration index
    in_iteration: bool = False
    iterations: int = 0              # iterations closed so far
    micro: int = 0                   # current micro-batch index
    micro_held: int = 0              # open micro_batch() contexts: their index holds across an iteration's start
    marks: int = 0                   # markers sent
    last: tuple[int, int] = (-1, -1)  # the latest marker (code, arg)
    seconds: dict[str, float] = field(default_factory=dict)  # time spent per stage (outermost wins)
    _open: list[tuple[str, float]] = field(default_factory=list)

    def track(self, code: int, arg: int) -> None:
        self.marks += 1
        self.last = (code, arg)
        if code in STAGE_OF:
            self._open.append((STAGE_OF[code], time.perf_counter()))
            self.stage = STAGE_OF[code]
            if code in (MARK_FORWARD_BEGIN, MARK_BACKWARD_BEGIN) and arg >= 0:
                self.micro = arg
        elif code in END_OF:
            name = STAGE_OF[END_OF[code]]
            for k in range(len(self._open) - 1, -1, -1):  # tolerate a missing end: close what it skipped
                if self._open[k][0] == name:
                    t0 = self._open[k][1]
                    del self._open[k:]
                    if not self._open:  # (a stage inside another is the outer one's time: an evaluation's
                        # forwards are evaluation, a recomputation's forward in a backward is backward)
                        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
                    break
            self.stage = self._open[-1][0] if self._open else None
        elif code == MARK_ITER_BEGIN:
            self._drop_stale()
            self.iteration = arg if arg >= 0 else self.iteration + 1
            self.in_iteration = True
            if not self.micro_held:
                self.micro = 0
        elif code == MARK_ITER_END:
            self._drop_stale()
            self.in_iteration = False
            self.iterations += 1

    def restart_counts(self) -> None:
        """Count markers, iterations and stage time from now on (what is open stays open, its time
        counted from now)."""
        now = time.perf_counter()
        self.marks, self.iterations, self.seconds = 0, 0, {}
        self._open = [(n, now) for n, _ in self._open]

    def _drop_stale(self) -> None:
        """At an iteration's bound a forward, backward or optimizer stage still open lost its end
        (a begin with no end, a backward that raised): drop it, its time uncounted, rather than
        keep it open for good (one more per iteration, and its stage's time never counted again)."""
        if any(n in _PER_ITERATION for n, _ in self._open):
            self._open = [(n, t) for n, t in self._open if n not in _PER_ITERATION]
            self.stage = self._open[-1][0] if self._open else None

    def is_open(self, stage: str) -> bool:
        return any(n == stage for n, _ in self._open)


def _profiling() -> bool:
    """Whether a torch.profiler run is recording (markers then go into its trace too)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch._C._autograd._profiler_enabled())
    except AttributeError:
        return False


def mark_profiled(code: int, arg: int = -1) -> None:
    """Put one marker into the running torch.profiler trace (a zero-length ``record_function``
    range named ``npu_pool::<marker>::<arg>``); captures turn it back into the marker."""
    import torch

    with torch.profiler.record_function(profiler_label(code_of(code), arg)):
        pass


def _marker_arg(arg: object) -> int:
    """``arg`` if it is a marker argument the pools take: an integer of 64 bits (-1: none; numpy's
    integers count, a bool does not)."""
    try:
        value = operator.index(arg) if not isinstance(arg, bool) else None
    except TypeError:
        value = None
    if value is None or not -(1 << 63) <= value < 1 << 63:
        raise ValueError(f"a marker argument is an int of 64 bits (-1: none), got {arg!r:.40}")
    return value


def _installed_targets() -> tuple[Any, ...]:
    """The installed allocator of the current device (never a device this process does not use)."""
    from ..install import current_pool

    p = current_pool()
    return (p,) if p is not None else ()


class Phase(contextlib.ContextDecorator):
    """A phase: its begin marker on entry and its end marker on exit; also a decorator."""

    def __init__(self, recorder: "Recorder", name: str, arg: int = -1):
        self._rec, self.name, self.arg = recorder, name, _marker_arg(arg)
        self._begin, self._end = phase_codes(name)
        self._args: list[int] = []  # a decorated function may be re-entered (its begin and end may
        # come from different threads: hooks)

    def __enter__(self) -> "Phase":
        arg = self.arg
        if arg < 0 and self._begin in (MARK_FORWARD_BEGIN, MARK_BACKWARD_BEGIN):
            arg = self._rec.state.micro  # the micro-batch it belongs to
        self._rec.mark(self._begin, arg)
        self._args.append(arg)  # (after the pools took it: a refused begin leaves nothing to end)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            arg = self._args.pop()  # (one call: two threads leaving at once never both see one entry)
        except IndexError:
            raise RuntimeError(f"phase {self.name!r} exited without being entered") from None
        self._rec.mark(self._end, arg)


class Recorder:
    """Sends phase markers (``MARK_*`` codes) to allocator pools.

    ``pools``: the :class:`~npu_pool.pool.Pool` objects to drive; ``None`` (default) means
    the installed allocator of the current device (``npu_pool.install.current_pool()``), looked up
    at each marker so that a recorder made before :func:`npu_pool.install` still works.
    ``profile``: also emit each marker as a ``record_function`` range named like
    :func:`mark_profiled` (``npu_pool::<mark>::<arg>``) while a torch.profiler
    run records, so captures carry the markers. A marker costs one C call per pool; the
    recorder does nothing per allocation.
    """

    def __init__(self, pools: Optional[Iterable[Any]] = None, *, profile: bool = True):
        self._pools = None if pools is None else tuple(pools)
        if self._pools is not None and not all(callable(getattr(p, "mark", None)) for p in self._pools):
            raise TypeError(f"pools are npu_pool Pool objects (or None: the installed one), got {self._pools!r:.80}")
        self.profile = profile
        self.state = RecorderState()
        self._listeners: list[Callable[[int, int], None]] = []

    def targets(self) -> tuple[Any, ...]:
        """The pools the next marker goes to."""
        return self._pools if self._pools is not None else _installed_targets()

    def mark(self, code: Union[int, str], arg: int = -1) -> None:
        """Send one marker (a ``MARK_*`` code or its name) with its argument. The recorder's state
        follows only markers every pool took (a bad argument or a closed pool changes nothing)."""
        code, arg = code_of(code), _marker_arg(arg)
        targets = self.targets()
        with _MARKING:  # (the pools take a marker and the state follows it in one order)
            for p in targets:
                p.mark(code, arg)
            self.state.track(code, arg)
        if self.profile and _profiling():
            mark_profiled(code, arg)
        for fn in list(self._listeners):  # (outside the lock: a listener may wait for another marker)
            fn(code, arg)

    def listen(self, fn: Callable[[int, int], None]) -> Callable[[], None]:
        """Call ``fn(code, arg)`` after each marker; returns a function that stops it."""
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn) if fn in self._listeners else None

    def phase(self, name: str, arg: int = -1) -> Phase:
        """Context manager / decorator for a phase: setup, iteration (step), forward,
        backward, optimizer, eval, layer."""
        return Phase(self, name, arg)

    def step(self, index: int = -1) -> Phase:
        """One training iteration (step boundaries); ``index`` -1 counts on from the last."""
        return Phase(self, "iteration", index)

    def layer(self, index: int) -> Phase:
        """Layer ``index`` (enter/exit markers)."""
        return Phase(self, "layer", index)

    @contextlib.contextmanager
    def micro_batch(self, index: int):
        """Micro-batch ``index``: forward and backward markers inside carry it as argument."""
        prev, self.state.micro = self.state.micro, _marker_arg(index)
        self.state.micro_held += 1
        try:
            yield self
        finally:
            self.state.micro_held -= 1
            self.state.micro = prev

    def reset_summary(self) -> None:
        """Start :meth:`summary`'s counts again (markers, iterations, seconds per stage), keeping the
        phases now open: a process forked from the recorded one that records on its own (a rank
        started with multiprocessing's fork) reports its own markers, not its parent's too."""
        with _MARKING:
            self.state.restart_counts()

    def summary(self) -> dict[str, Any]:
        """What was recorded: markers, iterations, seconds per stage (read as one: markers from other
        threads, torch's autograd threads, wait)."""
        s = self.state
        with _MARKING:
            return {"marks": s.marks, "iterations": s.iterations, "iteration": s.iteration,
                    "seconds": {k: round(v, 6) for k, v in s.seconds.items()}}


default = Recorder()
