"""Traces: the format, importers and capture."""
from .format import Trace, TraceError

__all__ = ["Trace", "TraceError"]
