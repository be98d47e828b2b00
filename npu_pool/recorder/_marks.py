"""Marker codes by name, the phases they open and close (codes of ``trace.format``), and the
name a marker has in a torch.profiler trace."""
from __future__ import annotations

from typing import Union

from ..trace.format import (MARK_BACKWARD_BEGIN, MARK_BACKWARD_END, MARK_EVAL_BEGIN, MARK_EVAL_END,
                            MARK_FORWARD_BEGIN, MARK_FORWARD_END, MARK_ITER_BEGIN, MARK_ITER_END, MARK_LAYER_ENTER,
                            MARK_LAYER_EXIT, MARK_NAMES, MARK_OPTIMIZER_BEGIN, MARK_OPTIMIZER_END, MARK_SETUP_BEGIN,
                            MARK_SETUP_END)
from ..vocab import STAGE_CLOSED, STAGE_OPENED, profiled_mark, profiler_label  # noqa: F401 (re-exported)

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
