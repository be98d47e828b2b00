"""npu_pool: a fragmentation-aware device memory pool for large-model training.

Its public names (``__all__``, documented in docs/api.md): ``Pool`` and its errors
(``PoolError``, ``OutOfMemoryError``, ``InvalidArgumentError``, ``DoubleFreeError``,
``UnknownPointerError``, ``BackendError``), ``POLICIES``; torch's device allocator:
``install``, ``installed``, ``current_pool``, ``set_fraction``, ``set_compaction``, ``compact``; colocated training and
inference: ``region``, ``pause``, ``resume``, ``set_backup_limit``, ``tags``. They load the
compiled core (and torch, for ``install``) on first use, so that ``import npu_pool`` itself
stays cheap.
"""
from __future__ import annotations

import typing as _typing

__version__ = "0.1.0"

_LAZY = {
    "Pool": "npu_pool.pool",
    "PoolError": "npu_pool.pool",
    "OutOfMemoryError": "npu_pool.pool",
    "InvalidArgumentError": "npu_pool.pool",
    "DoubleFreeError": "npu_pool.pool",
    "UnknownPointerError": "npu_pool.pool",
    "BackendError": "npu_pool.pool",
    "POLICIES": "npu_pool.pool",
    "install": "npu_pool.install",
    "installed": "npu_pool.install",
    "current_pool": "npu_pool.install",
    "set_fraction": "npu_pool.install",
    "set_compaction": "npu_pool.install",
    "compact": "npu_pool.install",
    "region": "npu_pool.colocate",
    "pause": "npu_pool.colocate",
    "resume": "npu_pool.colocate",
    "set_backup_limit": "npu_pool.colocate",
    "tags": "npu_pool.colocate",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> _typing.Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'npu_pool' has no attribute {name!r}")
    import importlib

    module = importlib.import_module(mod)
    # npu_pool.install is its module (which calls install() when called), whichever is asked first:
    # the function in its place hid npu_pool.install.installed() and the rest
    value = module if mod == f"{__name__}.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:  # the lazy public names too; not __future__'s `annotations`
    return sorted((set(globals()) - {"annotations"}) | set(__all__))
