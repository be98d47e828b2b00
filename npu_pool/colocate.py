"""Colocated RL: pause and resume tagged memory of the installed allocator (docs/colocated.md).

The trainer and the rollout engine share each device. Tensors allocated inside
``with npu_pool.region("train"):`` belong to the tag ``"train"`` and get their own address range;
``npu_pool.pause("train")`` gives their physical memory back to the device (addresses stay, so
tensors, graphs and pointers held elsewhere stay valid), ``npu_pool.resume("train")`` maps it back
at the same addresses. With ``backup=True`` the contents go to pinned host memory in between.

Each function acts on the installed allocator's pool of torch's current device, or on ``pool``.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Optional

from ._core import lib
from .install import current_pool, installed
from .pool import Pool, PoolError

__all__ = ["region", "pause", "resume", "tags", "set_backup_limit"]


def _pool(pool: Optional[Pool]) -> Pool:
    if pool is not None:
        if not isinstance(pool, Pool):
            raise TypeError(f"pool must be an npu_pool.Pool (or None: the installed one), not {type(pool).__name__}")
        return pool
    p = current_pool()
    if p is None and installed():  # (torch_npu refuses current_device() in a forked child, for one)
        raise PoolError(lib.NP_ERR_STATE, "npu_pool is installed, but torch cannot say which device is current "
                        "here (a forked child, or a device not started): pass pool=")
    if p is None:
        raise PoolError(lib.NP_ERR_STATE, "no npu_pool allocator is installed on the current device: call "
                        "npu_pool.install() first, or pass pool=")
    return p


def region(tag: str, pool: Optional[Pool] = None) -> AbstractContextManager[Any]:
    """``with npu_pool.region(tag):`` -- tensors allocated inside belong to ``tag``."""
    return _pool(pool).region(tag)


def pause(tag: str, backup: bool = False, pool: Optional[Pool] = None) -> int:
    """Give ``tag``'s physical memory back to the device (contents copied to pinned host memory
    first with ``backup``); returns the bytes given back."""
    return _pool(pool).pause(tag, backup)


def resume(tag: str, pool: Optional[Pool] = None) -> int:
    """Map ``tag``'s tensors back at their addresses and restore their backup; returns the bytes mapped."""
    return _pool(pool).resume(tag)


def tags(pool: Optional[Pool] = None) -> dict[str, dict[str, Any]]:
    """Every tag of the pool: allocated, mapped and paused bytes, backup bytes, state."""
    return _pool(pool).tags()


def set_backup_limit(nbytes: int, pool: Optional[Pool] = None) -> None:
    """Bound the pinned host bytes backups may hold (default: the device's memory)."""
    _pool(pool).set_backup_limit(nbytes)
