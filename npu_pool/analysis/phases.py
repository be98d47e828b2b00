"""What a trace's phase markers say about each event: iteration, stage, micro-batch, layer.

Markers (``OP_MARK``, ``MARK_*`` codes) are optional; a trace without them has one
stage, ``"-"``, everywhere. Stages are ``setup``, ``forward``, ``backward``,
``optimizer``, ``eval`` and ``step`` (inside an iteration, between the others).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator, NamedTuple

from ..trace.format import (MARK_BACKWARD_BEGIN, MARK_FORWARD_BEGIN, MARK_ITER_BEGIN, MARK_ITER_END,
                            MARK_LAYER_ENTER, MARK_LAYER_EXIT, OP_MARK, Trace)
from ..vocab import STAGE_CLOSED, STAGE_OPENED

__all__ = ["Phase", "PhaseTracker", "Span", "has_markers", "phase_at", "stage_spans"]

NO_STAGE = "-"
_BEGIN, _END = STAGE_OPENED, STAGE_CLOSED  # the core's stage table


@dataclass(frozen=True)
class Phase:
    """Where an event falls: ``stage`` plus the iteration, micro-batch and layer when known."""

    stage: str = NO_STAGE
    iteration: int | None = None
    micro: int | None = None
    layer: int | None = None
    marked: bool = False  # the trace has phase markers (an event outside every stage is then that)

    def describe(self) -> str:
        """``'iteration 1, backward of micro-batch 0, layer 3'``; ``'no phase markers'`` for a trace
        without any, ``'outside the marked stages'`` for an event before or between them."""
        if self.stage == NO_STAGE and self.iteration is None and not self.marked:
            return "no phase markers"
        parts = []
        if self.iteration is not None:
            parts.append(f"iteration {self.iteration}")
        stage = self.stage if self.stage != NO_STAGE else "outside the marked stages"
        if self.micro is not None and self.stage in ("forward", "backward"):
            stage += f" of micro-batch {self.micro}"
        parts.append(stage)
        if self.layer is not None:
            parts.append(f"layer {self.layer}")
        return ", ".join(parts)

    def as_dict(self) -> dict:
        return {"stage": self.stage, "iteration": self.iteration, "micro_batch": self.micro, "layer": self.layer,
                "text": self.describe()}


class PhaseTracker:
    """Feed markers in trace order with :meth:`mark`; :attr:`phase` is the phase now.

    ``span`` counts stage changes, so two events share a span exactly when no stage
    boundary lies between them (used to tell temporaries from tensors kept across stages).
    """

    def __init__(self) -> None:
        self.stage = NO_STAGE
        self.iteration: int | None = None
        self.micro: int | None = None
        self.layers: list[int] = []
        self.span = 0
        self._in_iter = False

    def mark(self, code: int, arg: int) -> None:
        if code in _BEGIN:
            self._enter(_BEGIN[code])
            if code in (MARK_FORWARD_BEGIN, MARK_BACKWARD_BEGIN):
                self.micro = arg if arg >= 0 else None
        elif code in _END:
            self._enter("step" if self._in_iter else NO_STAGE)
            self.layers.clear()
        elif code == MARK_ITER_BEGIN:
            self.iteration = arg if arg >= 0 else (0 if self.iteration is None else self.iteration + 1)
            self._in_iter = True
            self._enter("step")
        elif code == MARK_ITER_END:
            self._in_iter = False
            self._enter(NO_STAGE)
        elif code == MARK_LAYER_ENTER:
            self.layers.append(arg)
        elif code == MARK_LAYER_EXIT:
            if arg in self.layers:  # the innermost one (a recomputation's, inside the backward's); tolerate a
                # missing enter; drop anything opened inside
                del self.layers[len(self.layers) - 1 - self.layers[::-1].index(arg):]

    def _enter(self, stage: str) -> None:
        if stage != self.stage:
            self.stage = stage
            self.span += 1

    @property
    def phase(self) -> Phase:
        return Phase(self.stage, self.iteration, self.micro if self.stage in ("forward", "backward") else None,
                     self.layers[-1] if self.layers else None)


def has_markers(trace: Trace) -> bool:
    """Whether the trace carries any phase marker."""
    return OP_MARK in trace.op


def phase_at(trace: Trace, index: int) -> Phase:
    """The phase of event ``index`` (markers before it applied)."""
    t = PhaseTracker()
    if index < 0 or not has_markers(trace):
        return t.phase
    for op, cat, id_ in zip(trace.op[:index], trace.cat[:index], trace.id[:index]):
        if op == OP_MARK:
            t.mark(cat, id_)
    return replace(t.phase, marked=True)


class Span(NamedTuple):
    """Events ``start`` .. ``end - 1`` are in ``stage`` of ``iteration``."""

    start: int
    end: int
    stage: str
    iteration: int | None


def stage_spans(trace: Trace) -> list[Span]:
    """Maximal runs of events in one marked stage (runs outside any stage are left out)."""
    return [s for s in _all_spans(trace) if s.stage != NO_STAGE]


def _all_spans(trace: Trace) -> Iterator[Span]:
    t = PhaseTracker()
    start, stage, it = 0, t.stage, t.iteration
    for i, op in enumerate(trace.op):
        if op != OP_MARK:
            continue
        t.mark(trace.cat[i], trace.id[i])
        if t.stage != stage:
            if i > start:
                yield Span(start, i, stage, it)
            start, stage, it = i, t.stage, t.iteration
    if len(trace) > start:
        yield Span(start, len(trace), stage, it)
