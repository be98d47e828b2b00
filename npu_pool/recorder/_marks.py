"""Marker codes by name, the phases they open and close (codes of ``trace.format``), and the
name a marker has in a torch.profiler trace."""
from __future__ import annotations

from typing import Optional, Union

from ..trace.format import (MARK_BACKWARD_BEGIN, MARK_BACKWARD_END, MARK_EVAL_BEGIN, MARK_EVAL_END,
                            MARK_FORWARD_BEGIN, MARK_FORWARD_END, MARK_ITER_BEGIN, MARK_ITER_END, MARK_LAYER_ENTER,
                            MARK_LAYER_EXIT, MARK_NAMES, MARK_OPTIMIZER_BEGIN, MARK_OPTIMIZER_END, MARK_SETUP_BEGIN,
                            MARK_SETUP_END)
from ..vocab import STAGE_CLOSED, STAGE_OPENED

# phase name -> (begin code, end code); aliases map to the same pair.
PHASES: dict[str, tuple[int, int]] = {
    "setup": (MARK_SETUP_BEGIN, MARK_SETUP_END),
    "iteration": (MARK_ITER_BEGIN, MARK_ITER_END),
    "step": (MARK_ITER_BEGIN, MARK_ITER_END),
    "forward": (MARK_FORWARD_BEGIN, MARK_FORWARD_END),
    "backward": (MARK_BACKWARD_BEGIN, MARK_BACKWARD_END),
    "optimizer": (MARK_OPTIMIZER_BEGIN, MARK_OPTIMIZER_END),
    "eval": (MARK_EVAL_BEGIN, MARK_EVAL_END),
    "evaluation": (MARK_EVAL_BEGIN, MARK_EVAL_END),
    "layer": (MARK_LAYER_ENTER, MARK_LAYER_EXIT),
}
# begin code -> the stage it opens (layer markers open none: they only subdivide a stage);
# end code -> the begin code of the stage it closes. The table is the core's (vocab).
STAGE_OF: dict[int, str] = dict(STAGE_OPENED)
END_OF: dict[int, int] = {end: next(b for b, s in STAGE_OPENED.items() if s == stage)
                          for end, stage in STAGE_CLOSED.items()}
_BY_NAME = {n: i for i, n in enumerate(MARK_NAMES)}


def code_of(mark: Union[int, str]) -> int:
    """A ``MARK_*`` code from a code or a marker name (``"layer_enter"``); ValueError otherwise."""
    if isinstance(mark, bool) or not isinstance(mark, (int, str)):
        raise ValueError(f"a marker is a MARK_* code or one of {', '.join(MARK_NAMES)}; got {mark!r}")
    if isinstance(mark, str):
        if mark not in _BY_NAME:
            raise ValueError(f"unknown marker {mark!r}; choose one of {', '.join(MARK_NAMES)}")
        return _BY_NAME[mark]
    if not 0 <= mark < len(MARK_NAMES):
        raise ValueError(f"unknown marker code {mark}; codes are 0..{len(MARK_NAMES) - 1}")
    return mark


PROFILER_PREFIX = "npu_pool::"  # markers in a torch.profiler trace: record_function ranges named so


def profiler_label(code: int, arg: int) -> str:
    """The ``record_function`` name of a marker: ``npu_pool::<marker>::<arg>``."""
    return f"{PROFILER_PREFIX}{MARK_NAMES[code]}::{arg}"


def profiled_mark(name: str) -> Optional[tuple[int, int]]:
    """``(code, arg)`` of a profiler range named by :func:`profiler_label`; None for any other name."""
    if not name.startswith(PROFILER_PREFIX):
        return None
    parts = name.split("::")
    if len(parts) != 3 or parts[1] not in _BY_NAME:
        return None
    try:
        return _BY_NAME[parts[1]], int(parts[2])
    except ValueError:
        return None


def phase_codes(name: str) -> tuple[int, int]:
    """(begin, end) codes of a phase name; ValueError naming the accepted names."""
    try:
        return PHASES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown phase {name!r}; choose one of {', '.join(PHASES)}") from None


__all__ = ["PHASES", "STAGE_OF", "END_OF", "code_of", "phase_codes", "profiler_label", "profiled_mark",
           "MARK_LAYER_ENTER", "MARK_LAYER_EXIT",
           "MARK_ITER_BEGIN", "MARK_ITER_END", "MARK_FORWARD_BEGIN", "MARK_FORWARD_END", "MARK_BACKWARD_BEGIN",
           "MARK_BACKWARD_END", "MARK_OPTIMIZER_BEGIN", "MARK_OPTIMIZER_END", "MARK_EVAL_BEGIN", "MARK_EVAL_END",
           "MARK_SETUP_BEGIN", "MARK_SETUP_END"]
