"""Statistics of a trace that need no allocator: live bytes, op counts."""
from __future__ import annotations

from typing import NamedTuple

from .format import OP_ALLOC, OP_FREE, OP_INIT_ALLOC, OP_NAMES, Trace

__all__ = ["LiveProfile", "live_profile", "initial_live_bytes", "op_counts"]


class LiveProfile(NamedTuple):
    """Peak of the bytes requested and not yet freed, and the event index where it is reached."""

    peak_bytes: int
    peak_index: int  # -1 for a trace without allocations


def live_profile(trace: Trace) -> LiveProfile:
    """Peak live bytes (requested sizes, initial allocations included) and the first event reaching it."""
    live = peak = 0
    at = -1
    for i, (op, size) in enumerate(zip(trace.op, trace.size)):
        if op == OP_ALLOC or op == OP_INIT_ALLOC:
            live += size
            if live > peak:
                peak, at = live, i
        elif op == OP_FREE:
            live -= size
    return LiveProfile(peak, at)


def initial_live_bytes(trace: Trace) -> int:
    """Bytes already live when the recorded window began (sum of OP_INIT_ALLOC sizes)."""
    return sum(s for op, s in zip(trace.op, trace.size) if op == OP_INIT_ALLOC)


def op_counts(trace: Trace) -> dict[str, int]:
    """Number of events of each op, by name (ops that do not occur are left out)."""
    counts = [0] * 256
    for op in trace.op:
        counts[op] += 1
    return {OP_NAMES[op] if op < len(OP_NAMES) else str(op): n for op, n in enumerate(counts) if n}
