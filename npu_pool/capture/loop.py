"""The training loop both captures run (real CPU tensors in :mod:`.real`, fake ones in
:mod:`.fake`): iterations of forward and backward per micro-batch, then the optimizer step and
``zero_grad``, with a callback at every phase marker."""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from ..recorder import repeated_blocks
from ..trace.format import (MARK_BACKWARD_BEGIN, MARK_BACKWARD_END, MARK_FORWARD_BEGIN, MARK_FORWARD_END,
                            MARK_ITER_BEGIN, MARK_ITER_END, MARK_LAYER_ENTER, MARK_LAYER_EXIT, MARK_OPTIMIZER_BEGIN,
                            MARK_OPTIMIZER_END)

__all__ = ["Loop", "Mark", "autocast", "layer_hooks", "state_tensors", "storage_ptr"]

Mark = Callable[[int, int], None]


def _progress(steps: int, on: bool, desc: str) -> Iterable[int]:
    """``range(steps)``, wrapped in a tqdm bar when ``on`` and stderr is a tty."""
    if on and sys.stderr.isatty():
        try:
            from tqdm import tqdm
        except ImportError:
            return range(steps)
        return tqdm(range(steps), desc=desc, unit="step", leave=False)
    return range(steps)


def layer_hooks(model: nn.Module, mark: Mark) -> list[Any]:
    """Forward pre/post hooks on the repeated blocks emitting layer enter/exit markers."""
    handles = []
    for i, block in enumerate(repeated_blocks(model)):
        handles.append(block.register_forward_pre_hook(lambda *_a, i=i: mark(MARK_LAYER_ENTER, i)))
        handles.append(block.register_forward_hook(lambda *_a, i=i: mark(MARK_LAYER_EXIT, i)))
    return handles


@dataclass
class Loop:
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
    after_micro: Callable[[int], None] = lambda unit: None  # after each micro-batch, counted over the run

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        kw = {"generator": self.generator} if self.generator is not None else {}
        tokens = torch.randint(self.vocab, (self.batch, self.seq + 1), **kw)
        self.on_batch(tokens)
        return tokens[:, :-1], tokens[:, 1:]

    def run(self) -> None:
        amp = autocast(self.mixed_precision)
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
                self.after_micro(step * self.grad_accum + micro)
            self.mark(MARK_OPTIMIZER_BEGIN, step)
            self.before_opt(step)
            self.opt_step()
            self.zero_grad()
            self.mark(MARK_OPTIMIZER_END, step)
            self.mark(MARK_ITER_END, step)


def autocast(mixed_precision: str | None) -> Callable[[], contextlib.AbstractContextManager]:
    if mixed_precision is None:
        return contextlib.nullcontext
    if mixed_precision != "bf16":
        raise ValueError(f"mixed_precision must be None or 'bf16', not {mixed_precision!r}")
    return lambda: torch.autocast("cpu", dtype=torch.bfloat16)


def storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))
