"""A lock a forked child finds free: the package's module-level locks are of this kind.

A ``threading.Lock`` held by another thread when the process forks stays held in the child for
ever (that thread does not exist there), so the child's first use of it hangs. The core remakes
its own C locks at fork (fork.c); these are the Python side's. ``os.fork()`` waits for the lock
(so the state it guards is whole in the child), and the child gets a new one. A fork made by the
thread that holds it (nothing here does; a signal handler may) does not wait for itself, and its
child holds the new lock, to release it when that thread leaves its ``with``. Whether the forking
thread holds it is the lock's own answer (an ``RLock`` knows its owner from inside ``acquire``),
so a signal that lands between taking the lock and any bookkeeping cannot make a fork wait for
its own thread. Two threads may fork at once (their hooks interleave: the second waits in its
hook for the first's fork to release the lock): the lock records which thread its hook took it
for, so each fork releases only what its own hook took.
"""
from __future__ import annotations

import os
import threading
import weakref

__all__ = ["ForkSafeLock"]


class ForkSafeLock:
    """``with lock:``, re-entrant as a ``threading.RLock``, safe across ``os.fork()`` (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._forker: int | None = None  # the thread whose fork hook holds the lock, to release it in the parent
        if hasattr(os, "register_at_fork"):
            ref = weakref.ref(self)
            os.register_at_fork(before=lambda: _call(ref, "_before_fork"),
                                after_in_parent=lambda: _call(ref, "_after_in_parent"),
                                after_in_child=lambda: _call(ref, "_after_in_child"))

    def __enter__(self) -> "ForkSafeLock":
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def _before_fork(self) -> None:
        if not self._lock._is_owned():  # (the fork of a thread inside its with: no wait for itself)
            self._lock.acquire()
            self._forker = threading.get_ident()  # (set by the owner only: another fork's hook waits above)

    def _after_in_parent(self) -> None:
        if self._forker == threading.get_ident():
            self._forker = None
            self._lock.release()

    def _after_in_child(self) -> None:
        held = 0  # how deep the forking thread is inside its own with (nested, from a signal handler)
        if self._lock._is_owned() and self._forker != threading.get_ident():
            count = getattr(self._lock, "_recursion_count", None)
            held = count() if count else 1
        self._lock, self._forker = threading.RLock(), None
        for _ in range(held):
            self._lock.acquire()


def _call(ref: "weakref.ref[ForkSafeLock]", method: str) -> None:
    lock = ref()
    if lock is not None:
        getattr(lock, method)()
