"""The C placement kernel (``np_plan_place`` in csrc/plan.c), bound in cffi's ABI mode.

The kernel is compiled into ``npu_pool._core`` with the rest of the core, but it is
the planner's, not part of the allocator API (npu_pool.h's CDEF block), so it is
bound here from the exported symbol, as torch's pluggable-allocator loaders bind the
core's plain C entry points.
"""
from __future__ import annotations

import array
from functools import lru_cache
from typing import Any

from cffi import FFI

_CDEF = """
int np_plan_place(uint32_t n_pos, uint64_t n, const uint64_t *size, const uint32_t *span, const uint32_t *order,
                  uint64_t *offset, uint64_t *peak);
const char *np_last_error(void);
"""


@lru_cache(maxsize=1)
def _lib() -> tuple[FFI, Any]:
    from .. import _core

    ffi = FFI()
    ffi.cdef(_CDEF)
    return ffi, ffi.dlopen(_core.__file__)


def place(n_pos: int, size: array.array, span: array.array, order: array.array) -> tuple[array.array, int]:
    """Offsets of rectangles placed greedily in ``order`` and the peak (see plan.h)."""
    ffi, lib = _lib()
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
