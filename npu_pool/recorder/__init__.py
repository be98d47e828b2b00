"""Lifetime recorder: tell the allocator where training is (see docs/recorder.md).

Explicit phases (context managers and decorators)::

    from npu_pool import recorder
    with recorder.phase("setup"):
        model, opt = build()
    for i, batch in enumerate(data):
        with recorder.step(i):
            ...

or automatic ones from the model's structure::

    handle = recorder.attach(model, optimizer)   # layers, forward/backward, optimizer step
    ...
    handle.detach()

Markers go to the installed allocator of the current device (``npu_pool.install``) or to
the pools given to a :class:`Recorder`; each is one C call per pool (the allocator then
learns per request site whether blocks outlive their stage). While a torch.profiler run
records, markers also go into it (:func:`mark_profiled`: a ``record_function`` range named
``npu_pool::<marker>::<arg>``, read back by :func:`profiled_mark`), so captures carry them.
"""
from __future__ import annotations

from typing import Any, Union

from ._marks import PHASES, code_of, profiled_mark
from ._recorder import Phase, Recorder, RecorderState, default, mark_profiled

__all__ = ["Recorder", "RecorderState", "Phase", "PHASES", "default", "mark", "phase", "step", "layer",
           "micro_batch", "attach", "find_blocks", "repeated_blocks", "Attachment", "code_of", "mark_profiled",
           "profiled_mark"]


def mark(code: Union[int, str], arg: int = -1) -> None:
    """Send one marker through the default recorder."""
    default.mark(code, arg)


def phase(name: str, arg: int = -1) -> Phase:
    """A phase of the default recorder: setup, iteration (step), forward, backward, optimizer,
    eval, layer. Use as ``with phase("forward"):`` or as ``@phase("optimizer")``."""
    return default.phase(name, arg)


def step(index: int = -1) -> Phase:
    """One training iteration of the default recorder."""
    return default.step(index)


def layer(index: int) -> Phase:
    """Layer ``index`` of the default recorder."""
    return default.layer(index)


def micro_batch(index: int) -> Any:
    """Micro-batch ``index`` of the default recorder (its forward/backward carry the index)."""
    return default.micro_batch(index)


def __getattr__(name: str) -> Any:
    # attach/find_blocks need torch: import them on first use only
    if name in ("attach", "find_blocks", "repeated_blocks", "Attachment"):
        from . import _structure

        return getattr(_structure, name)
    raise AttributeError(f"module 'npu_pool.recorder' has no attribute {name!r}")
