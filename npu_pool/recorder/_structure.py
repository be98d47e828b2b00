"""Automatic markers: hooks that find a model's structure and mark it as it runs.

:func:`attach` puts forward pre/post hooks on the repeated transformer blocks (layer
enter/exit in the forward pass), gradient hooks on their outputs and inputs (layer
enter/exit in the backward pass, in the order the backward runs them), hooks on the
model itself (forward begin/end per micro-batch, backward begin where
``torch.autograd.backward`` is called, which attach() stands in for while a model is attached,
else at the output's gradient, and backward end through the autograd engine's
end-of-backward callback, evaluation for forwards without grad) and optimizer step pre/post
hooks (optimizer begin/end, iteration end).
Automatic markers only fill in where no phase was opened explicitly (``phase()``), so
explicit phases and hooks can be mixed.
"""
from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
from torch import nn

from ._marks import (MARK_BACKWARD_BEGIN, MARK_BACKWARD_END, MARK_EVAL_BEGIN, MARK_EVAL_END, MARK_FORWARD_BEGIN,
                     MARK_FORWARD_END, MARK_ITER_BEGIN, MARK_ITER_END, MARK_LAYER_ENTER, MARK_LAYER_EXIT,
                     MARK_OPTIMIZER_BEGIN, MARK_OPTIMIZER_END)
from ._recorder import Recorder, default
from ..vocab import OPTIMIZER_SKIPPED

# Containers of repeated layers, which keep them in ``.layers``: Megatron-core's
# TransformerBlock, its hybrid stacks (MambaStack; HybridStack in newer Megatron) and legacy
# Megatron's ParallelTransformer.
_STACKS = ("TransformerBlock", "MambaStack", "HybridStack", "ParallelTransformer")
_ATTR = "_npu_pool_grad_marks"
# order of markers that fire on the same gradient: backward begin, then layer exits, then enters
_ORDER = {MARK_BACKWARD_BEGIN: 0, MARK_LAYER_EXIT: 1, MARK_LAYER_ENTER: 2}

Model = Union[nn.Module, Sequence[nn.Module]]

# The attachment each hooked model (root module) has, while it is attached: a second attach
# would send every marker twice.
_attached: "weakref.WeakKeyDictionary[nn.Module, Attachment]" = weakref.WeakKeyDictionary()


def _modules(model: Model) -> list[nn.Module]:
    mods = list(model) if isinstance(model, (list, tuple)) else [model]
    for m in mods:
        if not isinstance(m, nn.Module):
            raise TypeError(f"attach() needs an nn.Module or a list of them (model chunks), got {type(m).__name__}")
    return mods


def _layer_index(layer: nn.Module, fallback: int) -> int:
    n = getattr(layer, "layer_number", None)  # Megatron: 1-based, global across pipeline stages
    return n - 1 if isinstance(n, int) and n >= 1 else fallback


def find_blocks(model: Model) -> list[tuple[int, nn.Module]]:
    """``(layer index, block)`` of the model's repeated transformer blocks.

    Megatron-core ``TransformerBlock`` and legacy ``ParallelTransformer``: their ``.layers``
    (index from ``layer_number``); otherwise (the project's GPT, Hugging Face models,
    any ``nn.ModuleList`` of layers) the longest ``nn.ModuleList`` whose children share one
    class. Empty when there is none."""
    found: list[tuple[int, nn.Module]] = []
    mods = _modules(model)
    for m in mods:
        for sub in m.modules():
            layers = getattr(sub, "layers", None)
            if type(sub).__name__ in _STACKS and isinstance(layers, nn.ModuleList):
                found.extend((_layer_index(layer, len(found)), layer) for layer in layers)
    if found:
        return found
    for m in mods:
        try:
            found.extend((_layer_index(b, len(found)), b) for b in repeated_blocks(m))
        except ValueError:
            continue
    return found


# What models call their list of transformer blocks (Hugging Face: `model.layers`, GPT-2's
# `transformer.h`, `blocks`): such a list wins over a longer one, a MoE layer's experts.
_BLOCK_LISTS = ("layers", "layer", "h", "blocks")


def repeated_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's repeated transformer blocks: ``layers`` if present, else the longest
    ModuleList whose children share one class, one named as blocks lists are (``layers``,
    ``layer``, ``h``, ``blocks``) first: a Hugging Face MoE model's layers (``.model.layers``)
    hold lists of more experts than there are layers."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    best: nn.ModuleList | None = None
    best_named = False
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) and len({type(c) for c in m}) == 1:
            named = name.rpartition(".")[2] in _BLOCK_LISTS
            if best is None or (named, len(m)) > (best_named, len(best)) or \
                    ((named, len(m)) == (best_named, len(best)) and _depth_ok(m, best)):
                best, best_named = m, named
    if best is None:
        raise ValueError(f"{type(model).__name__} has no repeated blocks (nn.ModuleList)")
    return best


def _depth_ok(m: nn.ModuleList, best: nn.ModuleList) -> bool:
    """Prefer the outer list when two lists tie (blocks over experts inside them)."""
    return any(c is best for c in m.modules())


def _grad_tensor(obj: Any, depth: int = 0) -> Optional[torch.Tensor]:
    """The first tensor that will receive a gradient in a (nested) output or argument."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.requires_grad else None
    if depth > 2:
        return None
    if isinstance(obj, dict):
        obj = obj.values()
    if isinstance(obj, (list, tuple, type({}.values()))):
        for x in obj:
            t = _grad_tensor(x, depth + 1)
            if t is not None:
                return t
    return None


class Attachment:
    """The hooks :func:`attach` installed; :meth:`detach` (or leaving a ``with``) removes them."""

    def __init__(self, recorder: Recorder, blocks: list[tuple[int, nn.Module]], backward: bool):
        self.recorder = recorder
        self.blocks = blocks
        self.backward = backward
        self.active = True
        self._handles: list[Any] = []
        self._restore: list[Callable[[], None]] = []
        self._depth = 0
        self._opened: list[int] = []      # end codes of the phases the root hooks opened
        self._opened_iteration = False
        self._micro = (-1, 0)             # (iteration, forwards seen in it)
        self._steps_hooked = False
        self._opened_opt = False
        self._fwd_micro = 0
        self._backward: Optional[int] = None  # the micro-batch of the backward _fire opened, until it ends
        self._awaiting: Optional[int] = None  # a forward's micro-batch whose backward has not begun yet
        self._roots = 0                   # the models (chunks) attach hooked

    # -- markers on gradients ---------------------------------------------------------
    def _on_grad(self, t: Optional[torch.Tensor], code: int, arg: int) -> None:
        """Send ``code`` when ``t``'s gradient is computed (several markers on one tensor
        fire in backward order: begin, exits, enters), once: a recomputation (activation
        checkpointing) runs the layer again on the same input tensor."""
        if t is None or not t.requires_grad:
            return
        marks = getattr(t, _ATTR, None)
        if marks is None:
            marks = []
            try:
                setattr(t, _ATTR, marks)
                t.register_hook(functools.partial(self._fire, marks))
            except (RuntimeError, AttributeError):
                return
        if (code, arg) not in marks:
            marks.append((code, arg))

    def _fire(self, marks: list[tuple[int, int]], grad: torch.Tensor) -> None:
        if not self.active:
            return
        rec = self.recorder
        for code, arg in sorted(marks, key=lambda m: _ORDER[m[0]]):
            if code == MARK_BACKWARD_BEGIN:
                early = self._backward == arg and rec.state.stage == "backward"  # (begun at backward())
                if rec.state.stage is not None and not early:
                    continue  # the caller marks its backward itself
                if not early:
                    rec.mark(MARK_BACKWARD_BEGIN, arg)
                    self._backward = arg
                self._awaiting = None
                torch.autograd.Variable._execution_engine.queue_callback(
                    functools.partial(self._backward_end, arg))
            else:
                rec.mark(code, arg)

    def _backward_called(self) -> None:
        """``torch.autograd.backward`` (``Tensor.backward``) is called, outside any backward: the
        backward of the forward that awaits one begins now, before the loss's own backward (a loss
        computed outside the model: its gradient, vocabulary-sized, is the backward's, not the
        step's); the gradient hook on the model's output then only ends it (_fire)."""
        rec = self.recorder
        if (not self.active or self._awaiting is None or rec.state.stage is not None
                or getattr(torch._C, "_current_graph_task_id", lambda: -1)() >= 0):
            return
        arg, self._awaiting = self._awaiting, None
        rec.mark(MARK_BACKWARD_BEGIN, arg)
        self._backward = arg

    def _backward_end(self, arg: int) -> None:
        self._backward = None
        if self.active and self.recorder.state.stage == "backward":
            self.recorder.mark(MARK_BACKWARD_END, arg)

    def _close_failed_backward(self, abandon: bool = False) -> None:
        """A backward that raised never runs its end callback: the next forward or optimizer step
        ends it (else the stage stayed "backward" and no later iteration was marked); one called
        from inside a running backward (a recomputation) is not a later one. ``abandon`` (the next
        forward): the step it was in went no further (a loop that skips a batch on an error), so
        the iteration these hooks opened ends too."""
        if self._backward is not None and getattr(torch._C, "_current_graph_task_id", lambda: -1)() < 0:
            self._backward_end(self._backward)
            if abandon:
                self._end_iteration()

    def _end_iteration(self) -> None:
        """End the iteration these hooks opened, if it is open."""
        rec = self.recorder
        if self._opened_iteration and rec.state.in_iteration:
            rec.mark(MARK_ITER_END, rec.state.iteration)
        self._opened_iteration = False

    # -- layers -------------------------------------------------------------------------
    def _layer_pre(self, index: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self.active:
            return
        self.recorder.mark(MARK_LAYER_ENTER, index)
        if self.backward and torch.is_grad_enabled():
            x = kwargs.get("hidden_states") if isinstance(kwargs.get("hidden_states"), torch.Tensor) else None
            self._on_grad(x if x is not None else _grad_tensor((args, kwargs)), MARK_LAYER_EXIT, index)

    def _layer_post(self, index: int, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        if not self.active:
            return
        self.recorder.mark(MARK_LAYER_EXIT, index)
        if self.backward and torch.is_grad_enabled():
            self._on_grad(_grad_tensor(out), MARK_LAYER_ENTER, index)

    # -- the model ----------------------------------------------------------------------
    def _micro_index(self) -> int:
        """The forward's micro-batch: forwards counted within the open iteration; 0 where none is
        open (attached without an optimizer, nothing else marking steps: the index grew with
        every forward of the run, each flagged a later micro-batch)."""
        st = self.recorder.state
        if not st.in_iteration:
            return 0
        it, n = self._micro
        self._micro = (st.iteration, n + 1) if it == st.iteration else (st.iteration, 1)
        return self._micro[1] - 1

    def _root_pre(self, module: nn.Module, args: tuple) -> None:
        self._depth += 1
        if not self.active or self._depth > 1:
            return
        rec = self.recorder
        if not torch.is_grad_enabled():
            if not rec.state.is_open("eval"):
                rec.mark(MARK_EVAL_BEGIN, -1)
                self._opened.append(MARK_EVAL_END)
            return
        self._close_failed_backward(abandon=True)
        if rec.state.stage is not None:
            return
        if self._steps_hooked and not rec.state.in_iteration:
            rec.mark(MARK_ITER_BEGIN, rec.state.iteration + 1)
            self._opened_iteration = True
        micro = self._micro_index()
        rec.mark(MARK_FORWARD_BEGIN, micro)
        self._opened.append(MARK_FORWARD_END)
        self._fwd_micro = micro

    def _root_post(self, module: nn.Module, args: tuple, out: Any) -> None:
        self._depth -= 1
        if not self.active or self._depth > 0:
            return
        failed = out is None  # (torch calls an always_call hook with None when the forward raised)
        while self._opened:
            code = self._opened.pop()
            if code == MARK_FORWARD_END:
                self.recorder.mark(code, self._fwd_micro)
                if self.backward:
                    self._on_grad(_grad_tensor(out), MARK_BACKWARD_BEGIN, self._fwd_micro)
                    self._awaiting = None if failed else self._fwd_micro
                if failed:  # the step goes no further (a loop that skips the batch): its iteration ends
                    self._end_iteration()
            else:
                self.recorder.mark(code, -1)

    # -- the optimizer ------------------------------------------------------------------
    def _opt_pre(self, *_: Any) -> None:
        rec = self.recorder
        if self.active:
            self._close_failed_backward()
        if self.active and rec.state.stage is None:
            rec.mark(MARK_OPTIMIZER_BEGIN, rec.state.iteration)
            self._opened_opt = True
        else:
            self._opened_opt = False

    def _opt_post(self, *_: Any, skipped: bool = False) -> None:
        rec = self.recorder
        if not self.active or not self._opened_opt:
            return
        self._opened_opt = False
        rec.mark(MARK_OPTIMIZER_END, OPTIMIZER_SKIPPED if skipped else rec.state.iteration)
        self._end_iteration()

    def _hook_optimizer(self, optimizer: Any) -> None:
        if isinstance(optimizer, torch.optim.Optimizer):
            self._handles.append(optimizer.register_step_pre_hook(self._opt_pre))
            self._handles.append(optimizer.register_step_post_hook(self._opt_post))
        elif callable(getattr(optimizer, "step", None)):  # Megatron's optimizers wrap torch's
            original = optimizer.step
            had_own = "step" in getattr(optimizer, "__dict__", {})

            @functools.wraps(original)
            def step(*args: Any, **kwargs: Any) -> Any:
                self._opt_pre()
                result = None
                try:
                    result = original(*args, **kwargs)
                    return result
                finally:  # Megatron's step returns (update_successful, grad_norm, zeros): False, skipped
                    self._opt_post(skipped=isinstance(result, tuple) and len(result) > 0 and result[0] is False)

            try:
                optimizer.step = step
            except AttributeError as e:  # (a read-only property, __slots__)
                raise TypeError(f"attach(optimizer=...) cannot wrap {type(optimizer).__name__}.step to mark it "
                                f"({e})") from None

            def restore() -> None:
                if had_own:
                    optimizer.step = original
                else:
                    vars(optimizer).pop("step", None)

            self._restore.append(restore)
        else:
            raise TypeError("attach(optimizer=...) needs an object with a step() method, "
                            f"got {type(optimizer).__name__}")
        self._steps_hooked = True

    def detach(self) -> None:
        """Remove every hook (gradient hooks already set on live tensors become no-ops)."""
        self.active = False
        for m, a in list(_attached.items()):
            if a is self:
                del _attached[m]
        for h in self._handles:
            h.remove()
        for r in reversed(self._restore):
            r()
        self._handles.clear()
        self._restore.clear()
        _watch_backward(False)

    def __enter__(self) -> "Attachment":
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()


_autograd_backward: Optional[Callable[..., Any]] = None  # torch's, while the wrapper below stands in for it


def _backward(*args: Any, **kwargs: Any) -> Any:
    """torch.autograd.backward while a model is attached: each attachment hears of the call first."""
    for att in dict.fromkeys(list(_attached.values())):  # (once each: the chunks of a model share one)
        att._backward_called()
    return _autograd_backward(*args, **kwargs)  # type: ignore[misc]


def _watch_backward(on: bool) -> None:
    """Stand in for torch.autograd.backward (Tensor.backward calls it) while any model is attached."""
    global _autograd_backward
    if on and _autograd_backward is None and torch.autograd.backward is not _backward:
        _autograd_backward, torch.autograd.backward = torch.autograd.backward, _backward
    elif not on and _autograd_backward is not None and not _attached:
        if torch.autograd.backward is _backward:  # (else someone wrapped it since: theirs stays, ours passes on)
            torch.autograd.backward = _autograd_backward
            _autograd_backward = None


def attach(model: Model, optimizer: Any = None, *, recorder: Optional[Recorder] = None,
           blocks: Optional[Iterable[nn.Module]] = None, backward: bool = True) -> Attachment:
    """Hook ``model`` (an ``nn.Module`` or a list of model chunks) and ``optimizer`` so that
    training sends its own markers; returns an :class:`Attachment` (``.detach()``).

    ``blocks``: the repeated layers, when :func:`find_blocks` does not find them.
    ``backward=False``: no gradient hooks (no backward begin/end or backward layer markers).
    ``optimizer``: a ``torch.optim.Optimizer`` (step pre/post hooks) or any object with a
    ``step()`` method such as Megatron's optimizers (wrapped). With an optimizer, the first
    forward after a step opens an iteration and the step closes it.
    """
    rec = recorder if recorder is not None else default
    mods = _modules(model)
    earlier = {_attached.get(m) for m in mods}
    if earlier != {None}:
        first = _attached.get(mods[0])
        if (optimizer is not None and earlier == {first} and first._roots == len(mods) and first.recorder is rec
                and not first._steps_hooked):
            first._hook_optimizer(optimizer)  # (a model attached before its optimizer existed: its step hooked now)
            return first
        raise RuntimeError(f"npu_pool.recorder.attach: this {type(mods[0]).__name__} is already attached (every "
                           "marker would be sent twice); detach() the first attachment before attaching again")
    found = [(i, b) for i, b in enumerate(blocks)] if blocks is not None else find_blocks(mods)
    if not found:
        warnings.warn(f"npu_pool.recorder.attach: no repeated blocks found in {type(mods[0]).__name__}; "
                      "no layer markers (pass blocks=...)", RuntimeWarning, stacklevel=2)
    att = Attachment(rec, found, backward)
    for index, block in found:
        att._handles.append(block.register_forward_pre_hook(functools.partial(att._layer_pre, index),
                                                            with_kwargs=True))
        att._handles.append(block.register_forward_hook(functools.partial(att._layer_post, index),
                                                        with_kwargs=True, always_call=True))
    for m in mods:
        att._handles.append(m.register_forward_pre_hook(att._root_pre))
        att._handles.append(m.register_forward_hook(att._root_post, always_call=True))
    att._roots = len(mods)
    if optimizer is not None:
        try:
            att._hook_optimizer(optimizer)
        except BaseException:  # (no step, or one that cannot be wrapped: nothing left hooked)
            att.detach()
            raise
    for m in mods:
        _attached[m] = att
    if backward:
        _watch_backward(True)
    return att
