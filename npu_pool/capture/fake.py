"""Allocation traces of shapes too large for this machine, with no memory behind them.

:func:`fake_capture` runs the same training loop as :func:`npu_pool.capture.capture`
(forward, backward, AdamW ``foreach``, ``zero_grad``; markers included) on a model
built under ``FakeTensorMode``: tensors carry shapes, dtypes and storages of the right
byte size but no data. A ``TorchDispatchMode`` stacked on top sees every aten op
(after CompositeImplicit decomposition, so composite intermediates are visible);
each output storage not seen before is an ``OP_ALLOC`` of ``storage.nbytes()``, and a
``weakref.finalize`` on that storage (PyObject-preserved, so it dies with the C++
StorageImpl) emits its ``OP_FREE``.

Categories come from context: parameters, gradients (live ``p.grad`` at each
optimizer step) and optimizer state by identity; the token batch and module buffers
are INPUT (as torch's memory profiler files them); a forward
allocation still live when its backward begins is ACTIVATION, else TEMPORARY;
other backward allocations are AUTOGRAD_DETAIL; other optimizer allocations are
TEMPORARY (0-dim ones, the step counters, are host scalars and are left out).

What this misses, compared with a real device capture:

* kernel-internal workspaces (GEMM/flash-attention scratch, cuDNN/cuBLAS
  workspaces, NCCL buffers): fake kernels compute shapes only and allocate none;
* allocations made below the dispatcher without an aten op (e.g. ``set_``/``resize_``
  growing a storage in place is seen at its first size only);
* MoE routing is perfectly balanced (fake tensors have no values to route on);
* tensor/pipeline parallel communication buffers (``tp`` slices shapes only, and
  ``pp`` divides the layer count while keeping embedding and head).
"""
from __future__ import annotations

import time
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..trace.format import (CAT_ACTIVATION, CAT_AUTOGRAD_DETAIL, CAT_GRADIENT, CAT_INPUT, CAT_OPTIMIZER_STATE,
                            CAT_PARAMETER, CAT_TEMPORARY, CAT_UNKNOWN, MARK_BACKWARD_BEGIN, MARK_BACKWARD_END,
                            MARK_FORWARD_BEGIN, MARK_FORWARD_END, MARK_OPTIMIZER_BEGIN, MARK_OPTIMIZER_END,
                            MARK_SETUP_BEGIN, MARK_SETUP_END, MAX_REQUEST, OP_ALLOC, OP_FREE, OP_MARK, Trace)
from .loop import Loop, autocast, layer_hooks, state_tensors

__all__ = ["fake_capture"]

_PHASE_AT = {MARK_SETUP_BEGIN: "setup", MARK_FORWARD_BEGIN: "forward", MARK_BACKWARD_BEGIN: "backward",
             MARK_OPTIMIZER_BEGIN: "optimizer", MARK_SETUP_END: "", MARK_FORWARD_END: "",
             MARK_BACKWARD_END: "", MARK_OPTIMIZER_END: ""}
_DEFAULT_CAT = {"backward": CAT_AUTOGRAD_DETAIL, "optimizer": CAT_TEMPORARY}


# The most events a fake capture records (about 0.7 GiB of trace, more while it is built): counts
# (steps, layers, cycles) that would clearly pass it are refused before anything is built (the
# estimates below are low ones: a flavour, precision or recompute records more), and a capture
# stops once it has recorded it.
MAX_EVENTS = 1 << 24
# The most layers a fake model has: each is modules and fake tensors in host memory and about 0.05 s
# of tracing a micro-batch, so 100,000 layers (under MAX_EVENTS for one step) ran for hours.
MAX_LAYERS = 1024


def check_events(estimate: int, what: str) -> None:
    """ValueError when a capture of ``what`` would record at least about ``estimate`` events, past
    MAX_EVENTS."""
    if estimate > MAX_EVENTS:
        raise ValueError(f"{what} would record at least {estimate:,} events, more than the {MAX_EVENTS:,} a "
                         "capture holds: capture fewer steps, layers or cycles")


def check_sizes(cfg: Any, batch: int, seq: int, what: str) -> None:
    """ValueError when a step of ``batch`` sequences of ``seq`` tokens would ask for a tensor larger
    than a request may be (2^48 bytes): the logits, the MLP's or the attention scores' (fp32, an
    upper bound). Said before any tensor is made: torch's fake tensors overflow past 2^63 bytes."""
    ffn = cfg.ffn or 4 * cfg.dim
    heads = max(1, cfg.n_heads // cfg.tp)
    largest = batch * seq * max(cfg.vocab // cfg.tp, ffn, cfg.dim, heads * seq) * 4
    if largest > MAX_REQUEST:
        raise ValueError(f"{what}: batch {batch} x sequence {seq} makes tensors of up to {largest:.3g} bytes, more "
                         f"than any device has (2^48): capture a smaller batch or sequence")


def events_full(n: int) -> None:
    """ValueError once a capture being built holds ``n`` events, past MAX_EVENTS."""
    if n > MAX_EVENTS:
        raise ValueError(f"the capture passed the {MAX_EVENTS:,} events a capture holds: capture fewer steps, "
                         "layers or cycles")


class _Recorder(TorchDispatchMode):
    """Records each new output storage as an allocation and its death as a free."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[int, int, int]] = []  # (op, id or mark code, arg)
        self.sizes: list[int] = []
        self.sites: list[int] = []
        self.phases: list[str] = []
        self.site_ids: dict[str, int] = {}
        self.cats: dict[int, int] = {}
        self.live: dict[int, int] = {}  # StorageImpl address -> id
        self.phase = ""
        self.modules: list[str] = []
        self.dropped = 0
        self._finalizers: list[weakref.finalize] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._see(t, func)
        return out

    def _see(self, t: torch.Tensor, func: Any) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key in self.live:
            return
        nbytes = st.nbytes()
        if nbytes == 0:
            return
        if nbytes <= 8 and self.phase == "optimizer":  # step counters: host scalars on a device
            self.dropped += 1
            return
        i = len(self.sizes)
        events_full(len(self.events))
        self.live[key] = i
        self.sizes.append(nbytes)
        where = self.modules[-1] if self.modules else (self.phase or "python")
        op = func._schema.name if hasattr(func, "_schema") else str(func)
        self.sites.append(self.site_ids.setdefault(f"{where}:{op}", len(self.site_ids)))
        self.phases.append(self.phase)
        self.events.append((OP_ALLOC, i, -1))
        self._finalizers.append(weakref.finalize(st, self._free, key, i))

    def _free(self, key: int, i: int) -> None:
        if self.live.get(key) == i:
            del self.live[key]
        self.events.append((OP_FREE, i, -1))

    def id_of(self, t: torch.Tensor) -> int | None:
        return self.live.get(t.untyped_storage()._cdata)

    def tag(self, tensors: Any, cat: int) -> None:
        """Give the live storages of ``tensors`` category ``cat``."""
        for t in tensors:
            i = self.id_of(t)
            if i is not None:
                self.cats[i] = cat

    def mark(self, code: int, arg: int) -> None:
        self.events.append((OP_MARK, code, arg))
        if code == MARK_BACKWARD_BEGIN:  # forward outputs still live are saved activations
            for i in self.live.values():
                if self.phases[i] == "forward":
                    self.cats.setdefault(i, CAT_ACTIVATION)
        self.phase = _PHASE_AT.get(code, self.phase)

    def close(self) -> None:
        """Stop listening for frees (storages dying after the capture)."""
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()

    def trace(self, meta: dict[str, Any]) -> Trace:
        freed = {i for op, i, _ in self.events if op == OP_FREE}
        cats = [self.cats.get(i, _DEFAULT_CAT.get(p, CAT_TEMPORARY if i in freed else CAT_UNKNOWN))
                for i, p in enumerate(self.phases)]
        t = Trace(meta={**meta, "sites": list(self.site_ids), "n_ids": len(self.sizes),
                        "host_scalars_dropped": self.dropped})
        for op, a, b in self.events:
            if op == OP_MARK:
                t.append(OP_MARK, cat=a, id=b)
            else:
                t.append(op, id=a, size=self.sizes[a], cat=cats[a], site=self.sites[a])
        return t


def _module_stack(rec: _Recorder) -> list[Any]:
    """Global forward hooks keeping ``rec.modules`` = classes of the modules being run."""
    from torch.nn.modules import module as _m

    def pre(mod: torch.nn.Module, _args: Any) -> None:
        rec.modules.append(type(mod).__name__)

    def post(mod: torch.nn.Module, _args: Any, _out: Any) -> None:
        if rec.modules:
            rec.modules.pop()

    return [_m.register_module_forward_pre_hook(pre), _m.register_module_forward_hook(post)]


def fake_capture(model_name: str = "llama", shape: str = "7b", steps: int = 1, batch: int = 1, seq: int = 2048, *,
                 layers: int | None = None, tp: int = 1, pp: int = 1, recompute: bool = False, grad_accum: int = 1,
                 mixed_precision: str | None = None, lr: float = 1e-3, progress: bool = True) -> Trace:
    """Trace ``steps`` training steps of flavour ``model_name`` at published ``shape``
    (``7b``/``13b``/``70b``) on one rank: ``tp`` slices heads, KV heads, MLP and vocab;
    ``layers`` (default: the shape's layers / ``pp``) sets the depth. No real memory."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..workloads import GPT, make_config, param_count

    if steps < 1 or grad_accum < 1 or batch < 1 or seq < 1 or tp < 1 or pp < 1:
        raise ValueError("steps, grad_accum, batch, seq, tp and pp must be >= 1")
    autocast(mixed_precision)
    cfg = make_config(model_name, shape, tp=tp)
    if layers is None and pp > cfg.n_layers:
        raise ValueError(f"pp={pp} stages for the {cfg.n_layers} layers of {model_name}-{shape}: a stage would hold none")
    n_layers = layers if layers is not None else max(1, cfg.n_layers // pp)
    if n_layers > MAX_LAYERS:
        raise ValueError(f"layers={n_layers}: at most {MAX_LAYERS} (published models have up to ~130)")
    check_events(120 * n_layers * steps * grad_accum,  # gpt's 124 a layer and micro-batch (llama 241, moe 790)
                 f"{steps} steps x {grad_accum} micro-batches of {n_layers} layers")
    cfg = make_config(model_name, shape, tp=tp, n_layers=n_layers, max_seq=max(seq, cfg.max_seq))
    check_sizes(cfg, batch, seq, f"{model_name}-{shape}")
    t0 = time.perf_counter()
    rec = _Recorder()
    hooks = _module_stack(rec)
    try:
        with FakeTensorMode(), rec:
            rec.mark(MARK_SETUP_BEGIN, -1)
            model = GPT(cfg).train()
            model.recompute = recompute
            optimizer = torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)
            hooks += layer_hooks(model, rec.mark)
            rec.tag(model.parameters(), CAT_PARAMETER)
            rec.tag(model.buffers(), CAT_INPUT)  # as torch's memory profiler files buffers (RoPE tables)
            rec.mark(MARK_SETUP_END, -1)
            params = list(model.parameters())

            def before_opt(step: int) -> None:
                rec.tag((p.grad for p in params if p.grad is not None), CAT_GRADIENT)

            def opt_step() -> None:
                optimizer.step()
                rec.tag(state_tensors(optimizer), CAT_OPTIMIZER_STATE)

            loop = Loop(model, opt_step, lambda: optimizer.zero_grad(set_to_none=True), rec.mark, steps, batch,
                         seq, cfg.vocab // cfg.tp, grad_accum, mixed_precision, progress, before_opt,
                         on_batch=lambda t: rec.tag([t], CAT_INPUT))
            loop.run()
    finally:
        for h in hooks:
            h.remove()
        rec.close()
    meta = dict(origin=f"npu_pool.fake_capture:{model_name}-{shape}", device=0, torch=torch.__version__,
                capture=dict(model=model_name, shape=shape, steps=steps, batch=batch, seq=seq, layers=n_layers,
                             tp=tp, pp=pp, recompute=recompute, grad_accum=grad_accum,
                             mixed_precision=mixed_precision, fake=True, param_count=param_count(cfg),
                             total_s=round(time.perf_counter() - t0, 3)),
                setup="profiled", expandable_segments=False,
                misses="kernel-internal workspaces, communication buffers; MoE routing balanced")
    return rec.trace(meta)
