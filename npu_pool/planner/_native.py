"""The C placement kernel (``np_plan_place`` in csrc/plan.c) through the core's binding."""
from __future__ import annotations

import array

from .._core import ffi, lib


def place(n_pos: int, size: array.array, span: array.array, order: array.array) -> tuple[array.array, int]:
    """Offsets of rectangles placed greedily in ``order`` and the peak (see plan.h)."""
    n = len(size)
    if size.typecode != "Q" or span.typecode != "I" or order.typecode != "I" or len(span) != 4 * n or len(order) != n:
        raise ValueError("place: size array('Q'), span array('I') of 4 per rectangle, order array('I')")
    offset = array.array("Q", bytes(8 * n))
    peak = ffi.new("uint64_t *")
    if n:
        rc = lib.np_plan_place(n_pos, n, ffi.from_buffer("uint64_t[]", size), ffi.from_buffer("uint32_t[]", span),
                               ffi.from_buffer("uint32_t[]", order), ffi.from_buffer("uint64_t[]", offset), peak)
        if rc != 0:
            raise RuntimeError(f"np_plan_place: {ffi.string(lib.np_last_error()).decode(errors='replace')}")
    return offset, int(peak[0])
