"""Traces: the format (:mod:`.format`), statistics (:mod:`.stats`), the importer of PyTorch
memory snapshots (:mod:`.snapshot`) and opening trace files of any kind (:mod:`.files`).
Capturing traces is :mod:`npu_pool.capture`."""
from .format import Trace, TraceError

__all__ = ["Trace", "TraceError"]
