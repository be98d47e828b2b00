"""cffi build of the C core into ``npu_pool._core`` (API mode, one shared object).

The same shared object exports the plain C entry points (``npu_pool_malloc``,
``npu_pool_free``, ...) that torch's pluggable-allocator loaders ``dlopen``.
Set ``NPU_POOL_DEBUG=1`` at build time for a debug build that checks invariants.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from cffi import FFI

CSRC = Path(__file__).resolve().parent / "csrc"


def _cdef() -> str:
    text = (CSRC / "npu_pool.h").read_text()
    m = re.search(r"/\* CDEF BEGIN \*/(.*)/\* CDEF END \*/", text, re.S)
    if not m:
        raise RuntimeError("npu_pool.h lacks its CDEF BEGIN/END markers")
    return re.sub(r"/\*.*?\*/", "", m.group(1), flags=re.S)


def _sources() -> list[str]:
    root = Path(__file__).resolve().parent.parent
    return sorted(str(p.relative_to(root)) for p in CSRC.glob("*.c"))


_debug = os.environ.get("NPU_POOL_DEBUG", "") not in ("", "0")
ffibuilder = FFI()
ffibuilder.cdef(_cdef())
ffibuilder.set_source(
    "npu_pool._core",
    '#include "npu_pool.h"',
    sources=_sources(),
    include_dirs=[str(CSRC)],
    define_macros=[("_GNU_SOURCE", None)] + ([("NP_DEBUG", "1")] if _debug else []),
    extra_compile_args=["-std=c11", "-fvisibility=default"] + (["-O0", "-g"] if _debug else ["-O2"]),
    libraries=["pthread", "m", "dl"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
