"""cffi build of the C core into ``npu_pool._core`` (API mode, one shared object): the one
binding between Python and C.

The same shared object exports the plain C entry points (``npu_pool_malloc``,
``npu_pool_free``, ...) that torch's pluggable-allocator loaders ``dlopen``. The binding
declares what ``npu_pool.h`` and ``pluggable.h`` mark between ``CDEF BEGIN``/``END``,
plus ``_npu_pool_on_oom``, a C function implemented in Python (``npu_pool.install``)
that the torch hooks call after a request failed for lack of memory.
Set ``NPU_POOL_DEBUG=1`` at build time for a debug build that checks invariants.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from cffi import FFI

CSRC = Path(__file__).resolve().parent / "csrc"
HEADERS = ("npu_pool.h", "pluggable.h")
PYTHON_CALLBACKS = 'extern "Python" void _npu_pool_on_oom(int device, uint64_t size, void *stream);'


def _cdef() -> str:
    blocks = []
    for name in HEADERS:
        text = (CSRC / name).read_text()
        m = re.search(r"/\* CDEF BEGIN \*/(.*)/\* CDEF END \*/", text, re.S)
        if not m:
            raise RuntimeError(f"{name} lacks its CDEF BEGIN/END markers")
        blocks.append(re.sub(r"/\*.*?\*/", "", m.group(1), flags=re.S))
    return "\n".join(blocks) + "\n" + PYTHON_CALLBACKS


def _sources() -> list[str]:
    root = Path(__file__).resolve().parent.parent
    return sorted(str(p.relative_to(root)) for p in CSRC.glob("*.c"))


_debug = os.environ.get("NPU_POOL_DEBUG", "") not in ("", "0")
ffibuilder = FFI()
ffibuilder.cdef(_cdef())
ffibuilder.set_source(
    "npu_pool._core",
    '#include "npu_pool.h"\n#include "pluggable.h"',
    sources=_sources(),
    include_dirs=[str(CSRC)],
    define_macros=[("_GNU_SOURCE", None)] + ([("NP_DEBUG", "1")] if _debug else []),
    extra_compile_args=["-std=c11", "-fvisibility=default"] + (["-O0", "-g"] if _debug else ["-O2"]),
    libraries=["pthread", "m", "dl"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
