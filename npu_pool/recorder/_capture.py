"""Captures whose markers come from the recorder (benchmarks and tests).

:func:`capture` runs :func:`npu_pool.trace.capture.capture` with the recorder's structure
hooks in place of its forward-only layer hooks, so the trace carries what a recorder-driven
device sees: layer markers in the forward and the backward pass (``markers="explicit"``:
the capture loop's own iteration/forward/backward/optimizer markers), or every marker but
set-up from :func:`~npu_pool.recorder.attach`'s hooks (``markers="auto"``).

It swaps two private names of ``npu_pool.trace.capture`` for the duration of the call
(``_layer_hooks`` and, for ``"auto"``, ``_mark_profiled``); a ``markers=`` parameter of
``capture()`` would make that unnecessary.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..trace import capture as _cap
from ..trace.format import MARK_SETUP_BEGIN, MARK_SETUP_END, Trace
from ._recorder import Recorder
from ._structure import attach

MARKERS = ("explicit", "auto", "forward-only")


class _Handle:
    def __init__(self, *removers: Any):
        self._removers = removers

    def remove(self) -> None:
        for r in self._removers:
            r()


def capture(*args: Any, markers: str = "auto", **kwargs: Any) -> Trace:
    """:func:`npu_pool.trace.capture.capture` (same arguments) with recorder markers.

    ``markers``: ``"auto"`` (attach()'s hooks mark everything after set-up), ``"explicit"``
    (the loop marks iterations, forward, backward, optimizer; the recorder adds layer
    markers in both passes) or ``"forward-only"`` (capture's own markers, unchanged)."""
    if markers not in MARKERS:
        raise ValueError(f"markers must be one of {', '.join(MARKERS)}, not {markers!r}")
    if markers == "forward-only":
        return _cap.capture(*args, **kwargs)
    real_mark = _cap._mark_profiled
    rec = Recorder(pools=(), profile=False)
    rec.listen(real_mark)

    def layer_hooks(model: torch.nn.Module, mark: Any) -> list[Any]:
        att = attach(model, recorder=rec)
        removers = [att.detach]
        if markers == "auto":  # the capture's optimizer: every optimizer's step, while capturing
            pre = register_optimizer_step_pre_hook(att._opt_pre)
            post = register_optimizer_step_post_hook(att._opt_post)
            att._steps_hooked = True
            removers += [pre.remove, post.remove]
        return [_Handle(*removers)]

    def setup_only(code: int, arg: int) -> None:
        if code in (MARK_SETUP_BEGIN, MARK_SETUP_END):
            real_mark(code, arg)

    def loop_mark(code: int, arg: int) -> None:  # explicit: the loop's markers, tracked by the recorder
        rec.mark(code, arg)

    saved = _cap._layer_hooks, _cap._mark_profiled
    _cap._layer_hooks = layer_hooks
    _cap._mark_profiled = setup_only if markers == "auto" else loop_mark
    try:
        trace = _cap.capture(*args, **kwargs)  # repeats the run if torch's profile cannot be read
    finally:
        _cap._layer_hooks, _cap._mark_profiled = saved
    trace.meta["markers"] = f"recorder:{markers}"
    return trace


def record_trace(train: Callable[[Recorder], tuple[Any, Any]], *, meta: Optional[dict[str, Any]] = None,
                 keep_host_scalars: bool = False) -> Trace:
    """Run ``train(recorder)`` under torch.profiler and return its allocation trace.

    ``train`` builds a model and trains it on CPU, sending markers through the recorder it
    is given (explicit phases, :func:`~npu_pool.recorder.attach`, or both), and returns
    ``(model, optimizer)`` so that persistent tensors are named as :func:`capture` names
    them: gradients at each optimizer step, parameters and optimizer state at the end.
    ``train`` may run more than once (see ``npu_pool.trace.capture.PROFILE_TRIES``): it must
    build what it trains."""
    return _cap.retrying(lambda: _record(train, meta, keep_host_scalars))


def _record(train: Callable[[Recorder], tuple[Any, Any]], meta: Optional[dict[str, Any]],
            keep_host_scalars: bool) -> Trace:
    ident = _cap._Identity()
    rec = Recorder(pools=(), profile=False)
    rec.listen(_cap._mark_profiled)

    def before_step(opt: Any, *_: Any) -> None:
        ident.grads[rec.state.iteration] = {_cap._storage_ptr(p.grad) for g in opt.param_groups
                                            for p in g["params"] if p.grad is not None}

    hook = register_optimizer_step_pre_hook(before_step)
    activities = [torch.profiler.ProfilerActivity.CPU]
    try:
        with torch.profiler.profile(activities=activities, profile_memory=True, record_shapes=True,
                                    with_stack=True) as prof:
            model, optimizer = train(rec)
            mods = model if isinstance(model, (list, tuple)) else [model]
            ident.params = {_cap._storage_ptr(p) for m in mods for p in m.parameters()}
            if isinstance(optimizer, torch.optim.Optimizer):
                ident.states = {_cap._storage_ptr(s) for s in _cap._state_tensors(optimizer)}
    finally:
        hook.remove()
    recs = _cap._profiler_records(prof)
    return _cap._to_trace(recs, ident, dict(origin="npu_pool.recorder.record_trace", device=0,
                                            torch=torch.__version__, **(meta or {})), keep_host_scalars)
