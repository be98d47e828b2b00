"""torch.profiler records -> an npu_pool trace: the one place that reads torch's private
profiler API (``MemoryProfile``), and the conversion to dense ids, identity-corrected
categories and a site table.

Every CPU allocator event is kept, kernel workspaces included, and turned into
``OP_ALLOC``/``OP_FREE`` with dense ids (requested bytes, stream 0, addr 0); a free of memory
allocated before profiling started becomes an ``OP_INIT_ALLOC`` up front. Markers are the
recorder's zero-length ``record_function`` ranges (:func:`npu_pool.recorder.mark_profiled`),
merged with allocation events by start time (ties keep the profiler's tree order).

Categories: the memory profiler's (``MemoryProfile._categories`` per tensor version, first
non-empty version wins), corrected by identity for the persistent kinds: the profiler assigns
PARAMETER/GRADIENT/OPTIMIZER_STATE per tensor id and sometimes attaches them to optimizer
temporaries, so those three come from the live ``p.grad`` storages at each optimizer step and
the live parameters and optimizer state at the end (:class:`Identity`). Allocations the
profiler cannot name (kernel workspaces with no tensor) are TEMPORARY when freed, else UNKNOWN.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, TypeVar

import torch

from ..recorder import profiled_mark
from ..trace.format import (CAT_GRADIENT, CAT_NAMES, CAT_OPTIMIZER_STATE, CAT_PARAMETER, CAT_TEMPORARY, CAT_UNKNOWN,
                            MARK_OPTIMIZER_BEGIN, MARK_OPTIMIZER_END, OP_ALLOC, OP_FREE, OP_INIT_ALLOC, OP_MARK,
                            Trace)

__all__ = ["CaptureError", "Identity", "profiling", "profiler_records", "to_trace", "host_scalar", "retrying",
           "PROFILE_TRIES"]

_PERSISTENT = (CAT_PARAMETER, CAT_GRADIENT, CAT_OPTIMIZER_STATE)


class CaptureError(RuntimeError):
    """The capture could not run (e.g. torch's private profiler API changed)."""


class CaptureTooLarge(CaptureError):
    """The run would not fit in the memory the machine has (never retried)."""


_KINETO_NOISE = ("USDT:", "STAGE:")  # lines torch's profiler backend writes to fd 2 at start and stop


@contextlib.contextmanager
def _quiet_kineto() -> Iterator[None]:
    """Drop the lines the profiler's C++ backend prints to stderr at start and stop (every
    capture would show them); anything else written meanwhile is passed on."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no file descriptor 2: nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [ln for ln in tmp.read().decode(errors="replace").splitlines(keepends=True)
                    if not ln.startswith(_KINETO_NOISE)]
            if kept:
                sys.stderr.write("".join(kept))


@contextlib.contextmanager
def profiling() -> Iterator[Any]:
    """``torch.profiler.profile`` of CPU memory (shapes, stacks) for a capture, quietly."""
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                  record_shapes=True, with_stack=True)
    with _quiet_kineto():
        prof.__enter__()
    try:
        yield prof
    finally:
        with _quiet_kineto():
            prof.__exit__(None, None, None)


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


def profiler_records(prof: Any) -> list[_Rec]:
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
        elif tag == op_tag and (mark := profiled_mark(ev.name)) is not None:
            out.append(_Rec("mark", code=mark[0], arg=mark[1]))
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


def host_scalar(r: _Rec) -> bool:
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


# -- records -> trace --------------------------------------------------------------------
@dataclass
class Identity:
    """Storage pointers of the persistent tensors, taken while they are live."""

    grads: dict[int, set[int]] = field(default_factory=dict)  # step -> grad storage ptrs
    params: set[int] = field(default_factory=set)
    states: set[int] = field(default_factory=set)


def to_trace(recs: list[_Rec], ident: Identity, meta: dict[str, Any], keep_host_scalars: bool) -> Trace:
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
            if not keep_host_scalars and host_scalar(r):
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
        except CaptureTooLarge:
            raise
        except CaptureError:
            if attempt == PROFILE_TRIES - 1:
                raise
    raise AssertionError("unreachable")
