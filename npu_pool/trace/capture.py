"""Capture real allocation traces of CPU training steps with ``torch.profiler``.

:func:`capture` builds a model, an AdamW optimizer and runs ``steps`` training
iterations (forward, backward per micro-batch, optimizer step, zero_grad) under
``torch.profiler.profile(profile_memory=True, record_shapes=True, with_stack=True)``.
Every CPU allocator event is kept, kernel workspaces included, and turned into
``OP_ALLOC``/``OP_FREE`` with dense ids (requested bytes, stream 0, addr 0).

Set-up is profiled too (between ``MARK_SETUP_BEGIN``/``MARK_SETUP_END``): model
weights are ordinary ``OP_ALLOC`` events of that phase. A free of memory allocated
before profiling started (should not happen) becomes an ``OP_INIT_ALLOC`` up front.

Categories: the memory profiler's (``MemoryProfile._categories`` per tensor version,
first non-empty version wins), corrected by identity for the persistent kinds: the
profiler assigns PARAMETER/GRADIENT/OPTIMIZER_STATE per tensor id and sometimes
attaches them to optimizer temporaries, so those three come from the live
``p.grad`` storages at each optimizer step and the live parameters and optimizer
state at the end. Allocations the profiler cannot name (kernel workspaces with no
tensor) are TEMPORARY when freed, else UNKNOWN.

Markers are zero-length ``record_function`` ranges named ``npu_pool::<mark>::<arg>``
(layer markers from forward pre/post hooks on the repeated blocks), merged with
allocation events by start time (ties keep the profiler's tree order).
"""
from __future__ import annotations

import contextlib
import functools
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, TypeVar

import torch
from torch import nn

from .format import (CAT_GRADIENT, CAT_NAMES, CAT_OPTIMIZER_STATE, CAT_PARAMETER, CAT_TEMPORARY,
                     CAT_UNKNOWN, MARK_BACKWARD_BEGIN, MARK_BACKWARD_END, MARK_FORWARD_BEGIN, MARK_FORWARD_END,
                     MARK_ITER_BEGIN, MARK_ITER_END, MARK_LAYER_ENTER, MARK_LAYER_EXIT, MARK_NAMES,
                     MARK_OPTIMIZER_BEGIN, MARK_OPTIMIZER_END, MARK_SETUP_BEGIN, MARK_SETUP_END, OP_ALLOC, OP_FREE,
                     OP_INIT_ALLOC, OP_MARK, Trace)

__all__ = ["capture", "summarize", "CaptureError", "DEFAULTS"]

# Default workload: 3 steps of this capture in a few seconds on 2 cores.
DEFAULTS: dict[str, Any] = dict(model="gpt", steps=3, batch=4, seq=128, layers=4, dim=128, heads=4, vocab=512)
_MARK_PREFIX = "npu_pool::"
_PERSISTENT = (CAT_PARAMETER, CAT_GRADIENT, CAT_OPTIMIZER_STATE)


class CaptureError(RuntimeError):
    """The capture could not run (e.g. torch's private profiler API changed)."""


Mark = Callable[[int, int], None]


# -- the training loop (shared with fake_capture) ------------------------------------
def _progress(steps: int, on: bool, desc: str) -> Iterable[int]:
    """``range(steps)``, wrapped in a tqdm bar when ``on`` and stderr is a tty."""
    if on and sys.stderr.isatty():
        try:
            from tqdm import tqdm
        except ImportError:
            return range(steps)
        return tqdm(range(steps), desc=desc, unit="step", leave=False)
    return range(steps)


def _layer_hooks(model: nn.Module, mark: Mark) -> list[Any]:
    """Forward pre/post hooks on the repeated blocks emitting layer enter/exit markers."""
    from ..models import repeated_blocks

    handles = []
    for i, block in enumerate(repeated_blocks(model)):
        handles.append(block.register_forward_pre_hook(lambda *_a, i=i: mark(MARK_LAYER_ENTER, i)))
        handles.append(block.register_forward_hook(lambda *_a, i=i: mark(MARK_LAYER_EXIT, i)))
    return handles


@dataclass
class _Loop:
    """One training run's knobs; :meth:`run` drives it and calls back at each phase."""

    model: nn.Module
    opt_step: Callable[[], None]
    zero_grad: Callable[[], None]
    mark: Mark
    steps: int
    batch: int
    seq: int
    vocab: int
    grad_accum: int = 1
    mixed_precision: str | None = None
    progress: bool = True
    before_opt: Callable[[int], None] = lambda step: None
    generator: torch.Generator | None = None
    on_batch: Callable[[torch.Tensor], None] = lambda tokens: None

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        kw = {"generator": self.generator} if self.generator is not None else {}
        tokens = torch.randint(self.vocab, (self.batch, self.seq + 1), **kw)
        self.on_batch(tokens)
        return tokens[:, :-1], tokens[:, 1:]

    def run(self) -> None:
        amp = _autocast(self.mixed_precision)
        for step in _progress(self.steps, self.progress, "capture"):
            self.mark(MARK_ITER_BEGIN, step)
            for micro in range(self.grad_accum):
                x, y = self._batch()
                # Recompute runs whole blocks (no early stop, which checkpoint reads at forward
                # time) so that recomputed blocks' layer exit markers fire too.
                with torch.utils.checkpoint.set_checkpoint_early_stop(False):
                    self.mark(MARK_FORWARD_BEGIN, micro)
                    with amp():
                        loss = self.model(x, y) / self.grad_accum
                    self.mark(MARK_FORWARD_END, micro)
                    self.mark(MARK_BACKWARD_BEGIN, micro)
                    loss.backward()
                    self.mark(MARK_BACKWARD_END, micro)
                del loss, x, y
            self.mark(MARK_OPTIMIZER_BEGIN, step)
            self.before_opt(step)
            self.opt_step()
            self.zero_grad()
            self.mark(MARK_OPTIMIZER_END, step)
            self.mark(MARK_ITER_END, step)


def _autocast(mixed_precision: str | None) -> Callable[[], contextlib.AbstractContextManager]:
    if mixed_precision is None:
        return contextlib.nullcontext
    if mixed_precision != "bf16":
        raise ValueError(f"mixed_precision must be None or 'bf16', not {mixed_precision!r}")
    return lambda: torch.autocast("cpu", dtype=torch.bfloat16)


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


# -- profiler access (all private torch API lives here) --------------------------------
@dataclass
class _Rec:
    """One allocator or marker event read from the profiler, in time order."""

    kind: str  # "alloc" | "free" | "mark"
    ptr: int = 0
    size: int = 0
    cat: int | None = None  # profiler category, None: unknown
    ops: tuple[str, ...] = ()  # enclosing torch ops, innermost first
    module: str = ""  # innermost enclosing nn.Module class
    code: int = -1
    arg: int = -1


def _profiler_records(prof: Any) -> list[_Rec]:
    """Allocation and marker events of a finished profile, with the memory profiler's
    categories; CaptureError naming the torch version if its private API changed."""
    try:
        return _read_profile(prof)
    except (ImportError, AttributeError, TypeError, KeyError, ValueError, AssertionError) as e:
        raise CaptureError(f"torch {torch.__version__}: reading torch.profiler._memory_profiler.MemoryProfile "
                           f"failed ({e!r}); npu_pool's capture was written against torch 2.13") from e


def _read_profile(prof: Any) -> list[_Rec]:
    """The only place that touches torch's private profiler API."""
    from torch._C._profiler import _EventType
    from torch.profiler._memory_profiler import Action, Category, MemoryProfile, TensorKey

    mp = MemoryProfile(prof.profiler.kineto_results)
    cat_code = {getattr(Category, n.upper()): i for i, n in enumerate(CAT_NAMES) if n != "unknown"}
    max_version: dict[Any, int] = {}
    for _t, action, (key, version), _n in mp.timeline:
        if action == Action.INCREMENT_VERSION:
            max_version[key] = max(max_version.get(key, 0), version + 1)
    categories = mp._categories
    alloc_tag, op_tag, py_tag = _EventType.Allocation, _EventType.TorchOp, _EventType.PyCall

    def category(key: Any) -> int | None:
        if key is None:
            return None
        for v in range(max_version.get(key, 0) + 1):
            c = categories.get(key, v)
            if c is not None:
                return cat_code[c]
        return None

    def context(event: Any) -> tuple[tuple[str, ...], str]:
        """Enclosing torch ops (innermost first) up to the innermost nn.Module, and its class."""
        ops: list[str] = []
        node = event.parent
        while node is not None:
            if node.tag == op_tag:
                ops.append(node.name)
            elif node.tag == py_tag and node.typed[1].module is not None:
                return tuple(ops), node.typed[1].module.cls_name
            node = node.parent
        return tuple(ops), ""

    out: list[_Rec] = []
    for ev in mp._op_tree.sorted_nodes:
        tag = ev.tag
        if tag == alloc_tag:
            a = ev.typed[1]
            if a.device.type != "cpu":
                continue
            if a.alloc_size > 0:
                ops, module = context(ev)
                out.append(_Rec("alloc", a.ptr, a.alloc_size, category(TensorKey.from_allocation(a)), ops, module))
            else:
                out.append(_Rec("free", a.ptr, -a.alloc_size))
        elif tag == op_tag and ev.name.startswith(_MARK_PREFIX):
            _, name, arg = ev.name.split("::")
            out.append(_Rec("mark", code=MARK_NAMES.index(name), arg=int(arg)))
    return out


def _site(ops: tuple[str, ...], module: str) -> str:
    """``Module:outer_op>inner_op``: the user-level op and the kernel that allocated."""
    real = [o for o in ops if o not in _FACTORIES] or list(ops)
    if not real:
        return f"{module or 'python'}:?"
    outer = real[-1].removeprefix("autograd::engine::evaluate_function: ")
    where = module or ("backward" if "Backward" in outer else "python")
    name = outer if len(real) == 1 or real[0] == real[-1] else f"{outer}>{real[0]}"
    return f"{where}:{name}"


def _host_scalar(r: _Rec) -> bool:
    """A 0-dim tensor that lives in host memory when training on an accelerator: a Python
    number wrapped by the argument parser (no enclosing op), the scalar operands of the
    CPU-only per-tensor ``_foreach_*`` fallback, and dtype casts of wrapped numbers."""
    if r.size > 8:
        return False
    real = [o for o in r.ops if o not in _FACTORIES]
    if not real or any(o.startswith("aten::_foreach_") for o in real):
        return True
    return real[0] == "aten::_to_copy" and len(real) > 1 and real[1] not in _CASTS


_CASTS = frozenset({"aten::to", "aten::_to_copy", "aten::type_as", "aten::_autocast_to_reduced_precision"})
_FACTORIES = frozenset({"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::zeros", "aten::zeros_like",
                        "aten::ones", "aten::ones_like", "aten::new_empty", "aten::new_zeros", "aten::new_empty_strided",
                        "aten::resize_", "aten::full", "aten::full_like"})


def _mark_profiled(code: int, arg: int) -> None:
    with torch.profiler.record_function(f"{_MARK_PREFIX}{MARK_NAMES[code]}::{arg}"):
        pass


# -- records -> trace --------------------------------------------------------------------
@dataclass
class _Identity:
    """Storage pointers of the persistent tensors, taken while they are live."""

    grads: dict[int, set[int]] = field(default_factory=dict)  # step -> grad storage ptrs
    params: set[int] = field(default_factory=set)
    states: set[int] = field(default_factory=set)


def _to_trace(recs: list[_Rec], ident: _Identity, meta: dict[str, Any], keep_host_scalars: bool) -> Trace:
    """Dense ids, identity-corrected categories, site table; INIT_ALLOCs first."""
    live: dict[int, int] = {}  # ptr -> id
    sizes: list[int] = []
    cats: list[int] = []
    sites: list[int] = []
    site_ids: dict[str, int] = {}
    init: list[int] = []
    freed: set[int] = set()
    in_optimizer: set[int] = set()
    forced: dict[int, int] = {}
    dropped: set[int] = set()  # ptrs of live host scalars left out
    n_dropped = 0
    phase_opt = False
    ordered: list[tuple[int, int, int]] = []  # (op, id or mark code, arg)
    for r in recs:
        if r.kind == "alloc":
            if r.ptr in live:  # a reuse without a free: close the old allocation
                freed.add(live[r.ptr]); ordered.append((OP_FREE, live.pop(r.ptr), -1))
            dropped.discard(r.ptr)
            if not keep_host_scalars and _host_scalar(r):
                dropped.add(r.ptr); n_dropped += 1
                continue
            i = len(sizes)
            live[r.ptr] = i
            sizes.append(r.size)
            cats.append(CAT_UNKNOWN if r.cat is None else r.cat)
            sites.append(site_ids.setdefault(_site(r.ops, r.module), len(site_ids)))
            if phase_opt:
                in_optimizer.add(i)
            ordered.append((OP_ALLOC, i, -1))
        elif r.kind == "free":
            if r.ptr in dropped:
                dropped.discard(r.ptr)
                continue
            i = live.pop(r.ptr, -1)
            if i < 0:  # allocated before profiling started
                i = len(sizes)
                sizes.append(r.size); cats.append(CAT_UNKNOWN); sites.append(-1); init.append(i)
            freed.add(i)
            ordered.append((OP_FREE, i, -1))
        else:
            if r.code == MARK_OPTIMIZER_BEGIN:
                phase_opt = True
                for p in ident.grads.get(r.arg, ()):
                    if p in live:
                        forced[live[p]] = CAT_GRADIENT
            elif r.code == MARK_OPTIMIZER_END:
                phase_opt = False
            ordered.append((OP_MARK, r.code, r.arg))
    for ptrs, c in ((ident.params, CAT_PARAMETER), (ident.states, CAT_OPTIMIZER_STATE)):
        for p in ptrs:
            if p in live:
                forced[live[p]] = c
    for i, c in enumerate(cats):
        if i in forced:
            cats[i] = forced[i]
        elif c in _PERSISTENT or c == CAT_UNKNOWN or i in in_optimizer:
            cats[i] = CAT_TEMPORARY if i in freed else CAT_UNKNOWN
    t = Trace(meta={**meta, "sites": list(site_ids), "n_ids": len(sizes), "host_scalars_dropped": n_dropped})
    for i in init:
        t.append(OP_INIT_ALLOC, id=i, size=sizes[i], cat=cats[i], site=sites[i])
    for op, a, b in ordered:
        if op == OP_MARK:
            t.append(OP_MARK, cat=a, id=b)
        else:
            t.append(op, id=a, size=sizes[a], cat=cats[a], site=sites[a])
    return t


# -- public API ----------------------------------------------------------------------------
def _model_overrides(layers: int | None, dim: int | None, heads: int | None, vocab: int | None,
                     seq: int) -> dict[str, Any]:
    return dict(n_layers=layers, dim=dim, n_heads=heads, vocab=vocab, max_seq=seq)


# torch 2.13's memory profiler sometimes fails its own data-flow check ("duplicate outputs")
# on a run it recorded (about 1 run in 10 of a megatron-core step). The training on CPU is
# deterministic, so such a run is simply repeated.
PROFILE_TRIES = 3
T = TypeVar("T")


def retrying(run: Callable[[], T]) -> T:
    """``run()``, repeated up to PROFILE_TRIES times while the profile cannot be read."""
    for attempt in range(PROFILE_TRIES):
        try:
            return run()
        except CaptureError:
            if attempt == PROFILE_TRIES - 1:
                raise
    raise AssertionError("unreachable")


def _retried(fn: Callable[..., T]) -> Callable[..., T]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        return retrying(lambda: fn(*args, **kwargs))

    return wrapper


@_retried
def capture(model_name: str = DEFAULTS["model"], steps: int = DEFAULTS["steps"], batch: int = DEFAULTS["batch"],
            seq: int = DEFAULTS["seq"], *, layers: int | None = DEFAULTS["layers"], dim: int | None = DEFAULTS["dim"],
            heads: int | None = DEFAULTS["heads"], vocab: int | None = DEFAULTS["vocab"], recompute: bool = False,
            grad_accum: int = 1, mixed_precision: str | None = None, lr: float = 1e-3, seed: int = 0,
            keep_host_scalars: bool = False, progress: bool = True) -> Trace:
    """Run ``steps`` real CPU training steps of ``model_name`` and return their trace.

    ``model_name`` is one of ``npu_pool.models.MODEL_NAMES``; ``layers``/``dim``/
    ``heads``/``vocab`` size it (None: the flavour's default). Each step runs
    ``grad_accum`` micro-batches of ``batch`` x ``seq`` tokens (forward, backward),
    then AdamW and ``zero_grad``. ``recompute`` checkpoints each block;
    ``mixed_precision="bf16"`` runs forwards under CPU bf16 autocast. 0-dim host
    scalars (see ``_host_scalar``) are left out unless ``keep_host_scalars``.
    """
    from ..models import build_model, prepare, set_recompute

    if steps < 1 or grad_accum < 1 or batch < 1 or seq < 1:
        raise ValueError("steps, grad_accum, batch and seq must be >= 1")
    _autocast(mixed_precision)  # validate early
    prepare(model_name)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    ident = _Identity()
    t0 = time.perf_counter()
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True, record_shapes=True,
                                with_stack=True) as prof:
        _mark_profiled(MARK_SETUP_BEGIN, -1)
        model = build_model(model_name, **_model_overrides(layers, dim, heads, vocab, seq))
        model.train()
        set_recompute(model, recompute)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)
        hooks = _layer_hooks(model, _mark_profiled)
        n_vocab = _vocab_of(model)
        _mark_profiled(MARK_SETUP_END, -1)

        def before_opt(step: int) -> None:
            ident.grads[step] = {_storage_ptr(p.grad) for p in model.parameters() if p.grad is not None}

        _Loop(model, optimizer.step, lambda: optimizer.zero_grad(set_to_none=True), _mark_profiled, steps, batch,
              seq, n_vocab, grad_accum, mixed_precision, progress, before_opt, gen).run()
        ident.params = {_storage_ptr(p) for p in model.parameters()}
        ident.states = {_storage_ptr(s) for s in _state_tensors(optimizer)}
        for h in hooks:
            h.remove()
    run_s = time.perf_counter() - t0
    recs = _profiler_records(prof)
    meta = dict(origin=f"npu_pool.capture:{model_name}", device=0, torch=torch.__version__,
                capture=dict(model=model_name, steps=steps, batch=batch, seq=seq, layers=layers, dim=dim,
                             heads=heads, vocab=n_vocab, recompute=recompute, grad_accum=grad_accum,
                             mixed_precision=mixed_precision, fake=False, run_s=round(run_s, 3),
                             total_s=round(time.perf_counter() - t0, 3)),
                setup="profiled", expandable_segments=False)
    return _to_trace(recs, ident, meta, keep_host_scalars)


def _vocab_of(model: nn.Module) -> int:
    cfg = getattr(model, "cfg", None)
    if cfg is not None:
        return cfg.vocab // cfg.tp
    hf = getattr(model, "hf", None)
    return int(hf.config.vocab_size) if hf is not None else 512


def summarize(trace: Trace) -> dict[str, Any]:
    """Event counts, peak live bytes and the bytes per category at that peak."""
    live = 0
    by_cat = [0] * len(CAT_NAMES)
    peak, peak_at, peak_cats = 0, -1, list(by_cat)
    allocs = frees = marks = 0
    for i, (op, cat, size) in enumerate(zip(trace.op, trace.cat, trace.size)):
        if op in (OP_ALLOC, OP_INIT_ALLOC):
            allocs += 1
            live += size
            by_cat[cat] += size
            if live > peak:
                peak, peak_at, peak_cats = live, i, list(by_cat)
        elif op == OP_FREE:
            frees += 1
            live -= size
            by_cat[cat] -= size
        elif op == OP_MARK:
            marks += 1
    return {"events": len(trace), "allocs": allocs, "frees": frees, "marks": marks, "peak_bytes": peak,
            "peak_event": peak_at, "end_bytes": live,
            "peak_by_category": {CAT_NAMES[c]: b for c, b in enumerate(peak_cats) if b}}
