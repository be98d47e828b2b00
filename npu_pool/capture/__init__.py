"""Capture allocation traces of training on this machine's CPU (needs torch).

- :func:`capture`: real CPU training steps of a demo workload under ``torch.profiler``
  (:mod:`.real`), markers from the training loop or from the recorder's hooks;
- :func:`record_trace`: any training function under ``torch.profiler``, markers from the
  recorder it is given;
- :func:`fake_capture`: the same loop on fake tensors, for shapes too large for this
  machine (:mod:`.fake`);
- :mod:`.loop` is the loop both run, :mod:`.profile` turns a profile into a trace.

The trace format and the importers of other tools' files are :mod:`npu_pool.trace`.
"""
from __future__ import annotations

from typing import Any

__all__ = ["capture", "record_trace", "fake_capture", "CaptureError", "DEFAULTS", "MARKERS"]

_LAZY = {"capture": ".real", "record_trace": ".real", "DEFAULTS": ".real", "MARKERS": ".real",
         "fake_capture": ".fake", "CaptureError": ".profile"}


def __getattr__(name: str) -> Any:
    # torch loads on first use only: `npu-pool --help` and the trace tools stay fast
    if name not in _LAZY:
        raise AttributeError(f"module 'npu_pool.capture' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name], __name__), name)
