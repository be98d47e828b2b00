"""Capture real allocation traces of CPU training steps with ``torch.profiler``.

:func:`capture` builds a demo workload (:mod:`npu_pool.workloads`), an AdamW optimizer and runs
``steps`` training iterations (:class:`~.loop.Loop`) under ``torch.profiler.profile(
profile_memory=True, record_shapes=True, with_stack=True)``; :func:`record_trace` profiles any
training function the same way. Set-up is profiled too (between ``MARK_SETUP_BEGIN`` and
``MARK_SETUP_END``): model weights are ordinary ``OP_ALLOC`` events of that phase. The
profile becomes a trace in :mod:`.profile`.

Where the markers come from (``markers``):

- ``"loop"``: the loop marks iterations, forward, backward and the optimizer step;
  forward pre/post hooks on the repeated blocks mark layers in the forward pass;
- ``"explicit"``: the loop's markers, and the recorder's :func:`~npu_pool.recorder.attach`
  hooks mark layers in the forward *and* the backward pass (what a device sees with
  explicit phases plus ``attach``);
- ``"auto"``: everything after set-up from ``attach(model, optimizer)``'s hooks alone
  (what a device sees with ``attach`` and nothing else).
"""
from __future__ import annotations

import functools
import os
import time
from typing import Any, Callable, Optional, TypeVar

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..recorder import Recorder, attach, mark_profiled
from ..trace.format import MARK_SETUP_BEGIN, MARK_SETUP_END, Trace
from .loop import Loop, Mark, autocast, layer_hooks, state_tensors, storage_ptr
from .profile import CaptureTooLarge, Identity, profiler_records, profiling, retrying, to_trace

__all__ = ["capture", "record_trace", "DEFAULTS", "MARKERS"]

# Default workload: 3 steps of this capture in a few seconds on 2 cores.
DEFAULTS: dict[str, Any] = dict(model="gpt", steps=3, batch=4, seq=128, layers=4, dim=128, heads=4, vocab=512)
MARKERS = ("loop", "explicit", "auto")
T = TypeVar("T")


def _retried(fn: Callable[..., T]) -> Callable[..., T]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        return retrying(lambda: fn(*args, **kwargs))

    return wrapper


def _markers(markers: str) -> tuple[Mark, Callable[[nn.Module, Any], list[Callable[[], None]]]]:
    """The loop's marker function and what hooks the model, for ``markers`` (see the module)."""
    if markers not in MARKERS:
        raise ValueError(f"markers must be one of {', '.join(MARKERS)}, not {markers!r}")
    if markers == "loop":
        return mark_profiled, lambda model, opt: [h.remove for h in layer_hooks(model, mark_profiled)]
    rec = Recorder(pools=(), profile=False)
    rec.listen(mark_profiled)
    if markers == "explicit":
        return rec.mark, lambda model, opt: [attach(model, recorder=rec).detach]
    return (lambda code, arg: None), lambda model, opt: [attach(model, opt, recorder=rec).detach]


def _model_overrides(layers: int | None, dim: int | None, heads: int | None, vocab: int | None,
                     seq: int) -> dict[str, Any]:
    return dict(n_layers=layers, dim=dim, n_heads=heads, vocab=vocab, max_seq=seq)


@_retried
def capture(model_name: str = DEFAULTS["model"], steps: int = DEFAULTS["steps"], batch: int = DEFAULTS["batch"],
            seq: int = DEFAULTS["seq"], *, layers: int | None = DEFAULTS["layers"], dim: int | None = DEFAULTS["dim"],
            heads: int | None = DEFAULTS["heads"], vocab: int | None = DEFAULTS["vocab"], recompute: bool = False,
            grad_accum: int = 1, mixed_precision: str | None = None, lr: float = 1e-3, seed: int = 0,
            keep_host_scalars: bool = False, progress: bool = True, markers: str = "loop") -> Trace:
    """Run ``steps`` real CPU training steps of ``model_name`` and return their trace.

    ``model_name`` is one of ``npu_pool.workloads.MODEL_NAMES``; ``layers``/``dim``/
    ``heads``/``vocab`` size it (None: the flavour's default). Each step runs
    ``grad_accum`` micro-batches of ``batch`` x ``seq`` tokens (forward, backward),
    then AdamW and ``zero_grad``. ``recompute`` checkpoints each block;
    ``mixed_precision="bf16"`` runs forwards under CPU bf16 autocast. 0-dim host
    scalars (:func:`~.profile.host_scalar`) are left out unless ``keep_host_scalars``.
    ``markers``: ``"loop"``, ``"explicit"`` or ``"auto"`` (see the module).
    """
    from ..workloads import build_model, prepare, set_recompute

    if steps < 1 or grad_accum < 1 or batch < 1 or seq < 1:
        raise ValueError("steps, grad_accum, batch and seq must be >= 1")
    autocast(mixed_precision)  # validate early
    loop_mark, hook = _markers(markers)
    prepare(model_name)
    _check_fits(model_name, _model_overrides(layers, dim, heads, vocab, seq), batch, seq)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    ident = Identity()
    t0 = time.perf_counter()
    with profiling() as prof:
        mark_profiled(MARK_SETUP_BEGIN, -1)
        model = build_model(model_name, **_model_overrides(layers, dim, heads, vocab, seq))
        model.train()
        set_recompute(model, recompute)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)
        removers = hook(model, optimizer)
        n_vocab = _vocab_of(model)
        mark_profiled(MARK_SETUP_END, -1)

        guard = _MemoryGuard(steps, grad_accum)

        def before_opt(step: int) -> None:
            ident.grads[step] = {storage_ptr(p.grad) for p in model.parameters() if p.grad is not None}

        try:
            Loop(model, optimizer.step, lambda: optimizer.zero_grad(set_to_none=True), loop_mark, steps, batch,
                 seq, n_vocab, grad_accum, mixed_precision, progress, before_opt, gen, after_micro=guard.check).run()
        finally:
            for remove in removers:
                remove()
        ident.params = {storage_ptr(p) for p in model.parameters()}
        ident.states = {storage_ptr(s) for s in state_tensors(optimizer)}
    run_s = time.perf_counter() - t0
    recs = profiler_records(prof)
    meta = dict(origin=f"npu_pool.capture:{model_name}", device=0, torch=torch.__version__,
                capture=dict(model=model_name, steps=steps, batch=batch, seq=seq, layers=layers, dim=dim,
                             heads=heads, vocab=n_vocab, recompute=recompute, grad_accum=grad_accum,
                             mixed_precision=mixed_precision, fake=False, run_s=round(run_s, 3),
                             total_s=round(time.perf_counter() - t0, 3)),
                setup="profiled", expandable_segments=False, markers=markers)
    return to_trace(recs, ident, meta, keep_host_scalars)


def _check_fits(model_name: str, overrides: dict[str, Any], batch: int, seq: int) -> None:
    """CaptureTooLarge before anything is built when the run would need more host memory than the
    system has available, from a low estimate: AdamW's fp32 weights, gradients and two states (16
    bytes a parameter) and one micro-batch's logits with their gradient (8 bytes a token and vocabulary
    entry) -- a larger model would fail in torch's allocator half-way or fill the host's memory."""
    from ..workloads import make_config, param_count

    cfg = make_config(model_name, **overrides)  # (ValueError for a shape the model cannot take)
    params = param_count(cfg)
    need = 16 * params + 8 * batch * seq * cfg.vocab
    free = _MemoryGuard._available()
    if free is not None and need > free:
        raise CaptureTooLarge(f"a real capture of {model_name} with {params:,} parameters and micro-batches of "
                              f"{batch}x{seq} tokens needs at least {need / 2**30:.1f} GiB of host memory, more than "
                              f"the {free / 2**30:.1f} GiB this machine has available: make it smaller (--dim, "
                              "--layers, --vocab, --batch, --seq), or capture a published shape with --fake --shape")


class _MemoryGuard:
    """The profiler keeps every op of the run in host memory (about 27 MB a step for the default
    small model, `npu-pool capture --steps 5` against `--steps 25`; about 23 MB a micro-batch):
    after each micro-batch from the second on, the growth per micro-batch since the first is
    projected over the micro-batches left, three times over (a margin: later steps grew more than
    the second, and the profile is read afterwards), and a run that would not fit in the memory
    the system has available stops then, with a CaptureTooLarge (a CaptureError) saying how many
    steps would fit, instead of being killed. Checked per micro-batch, not per step: one step of
    many micro-batches (``--grad-accum``) grows as much as many steps. Linux only (/proc);
    elsewhere it checks nothing."""

    def __init__(self, steps: int, grad_accum: int = 1) -> None:
        self.steps, self.grad_accum, self.first = steps, grad_accum, None

    @staticmethod
    def _rss() -> int | None:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return None

    @staticmethod
    def _available() -> int | None:
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        return None

    def check(self, unit: int) -> None:
        """After micro-batch ``unit`` (counted over the run from 0): note the memory after the
        first, project it after each later one."""
        now = self._rss()
        if unit == 0 or self.first is None:
            self.first = now if unit == 0 else None
            return
        left = self.steps * self.grad_accum - 1 - unit
        if now is None or left <= 0:
            return
        per_unit = max(0, now - self.first) / unit
        need = 3 * per_unit * left
        free = self._available() if need > 0 else None
        if free is None or need <= free:
            return
        fit_units = unit + 1 + int(free // (3 * per_unit))  # (need > free >= 0: per_unit > 0)
        what = "a step" if self.grad_accum == 1 else "a micro-batch"
        if fit_units >= self.grad_accum:
            fix = f"capture at most {fit_units // self.grad_accum} steps (an iteration repeats; a few show it)"
        elif fit_units >= self.steps:
            fix = (f"lower --grad-accum to at most {fit_units // self.steps} for {self.steps} step"
                   f"{'s' if self.steps > 1 else ''} (or --batch, --seq)")
        else:
            fix = f"capture 1 step with --grad-accum at most {fit_units} (or lower --batch, --seq)"
        of = f" of {self.grad_accum} micro-batches" if self.grad_accum > 1 else ""
        raise CaptureTooLarge(f"capturing {self.steps} steps{of} would hold about "
                              f"{need / 2**30:.1f} GiB more of profiler records ({per_unit / 2**20:.0f} MiB {what}) "
                              f"than the {free / 2**30:.1f} GiB this machine has available: {fix}")


def _vocab_of(model: nn.Module) -> int:
    cfg = model.cfg
    return cfg.vocab // cfg.tp


def record_trace(train: Callable[[Recorder], tuple[Any, Any]], *, meta: Optional[dict[str, Any]] = None,
                 keep_host_scalars: bool = False) -> Trace:
    """Run ``train(recorder)`` under torch.profiler and return its allocation trace.

    ``train`` builds a model and trains it on CPU, sending markers through the recorder it
    is given (explicit phases, :func:`~npu_pool.recorder.attach`, or both), and returns
    ``(model, optimizer)`` so that persistent tensors are named as :func:`capture` names
    them: gradients at each optimizer step, parameters and optimizer state at the end.
    ``train`` may run more than once (see :data:`~.profile.PROFILE_TRIES`): it must
    build what it trains."""
    return retrying(lambda: _record(train, meta, keep_host_scalars))


def _record(train: Callable[[Recorder], tuple[Any, Any]], meta: Optional[dict[str, Any]],
            keep_host_scalars: bool) -> Trace:
    ident = Identity()
    rec = Recorder(pools=(), profile=False)
    rec.listen(mark_profiled)

    def before_step(opt: Any, *_: Any) -> None:
        ident.grads[rec.state.iteration] = {storage_ptr(p.grad) for g in opt.param_groups
                                            for p in g["params"] if p.grad is not None}

    hook = register_optimizer_step_pre_hook(before_step)
    try:
        with profiling() as prof:
            model, optimizer = train(rec)
            mods = model if isinstance(model, (list, tuple)) else [model]
            ident.params = {storage_ptr(p) for m in mods for p in m.parameters()}
            if isinstance(optimizer, torch.optim.Optimizer):
                ident.states = {storage_ptr(s) for s in state_tensors(optimizer)}
    finally:
        hook.remove()
    return to_trace(profiler_records(prof), ident, dict(origin="npu_pool.capture.record_trace", device=0,
                                                        torch=torch.__version__, **(meta or {})), keep_host_scalars)
