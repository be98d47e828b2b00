"""Plans on pools: install one on a ``"planned"`` pool, read its counters, load NPU_POOL_PLAN."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Union

from .._core import ffi, lib
from .plan import Plan
from .planfile import load_plan

__all__ = ["COUNTS", "ENV", "as_plan", "install", "remove", "counts", "plan_from_env"]

COUNTS = ("served", "fallback", "idle", "resyncs")  # np_set_plan's counters, in order
ENV = "NPU_POOL_PLAN"

PlanLike = Union[Plan, str, Path]


def as_plan(plan: PlanLike) -> Plan:
    """``plan`` itself, or the plan file it names."""
    return plan if isinstance(plan, Plan) else load_plan(plan)


def _set(pool: Any, n: int, cols: tuple = (ffi.NULL,) * 3, region: int = 0, loop: int = 0,
         flags: int = 0) -> dict[str, int]:
    from ..pool import _check

    out = ffi.new("uint64_t[]", len(COUNTS))
    _check(lib.np_set_plan(pool.ctx, n, loop, *cols, region, flags, out))
    return dict(zip(COUNTS, (int(x) for x in out)))


def install(pool: Any, plan: PlanLike) -> None:
    """Install ``plan`` (a Plan or a plan file) on ``pool``, whose policy must be ``"planned"``.
    Install before the first allocation: the region is reserved at the first planned request,
    and the fallback arena (when the device has no virtual-memory API) is sized to leave room."""
    p = as_plan(plan)
    cols = tuple(ffi.from_buffer("uint64_t[]", a) for a in (p.size, p.offset, p.end))
    _set(pool, p.n, cols, p.region, p.loop, p.flags)


def remove(pool: Any) -> None:
    """Remove the pool's plan (every request then goes to the fallback)."""
    _set(pool, 0, (ffi.new("uint64_t[]", 1),) + (ffi.NULL,) * 2)


def counts(pool: Any) -> dict[str, int]:
    """Requests served from the plan, fallen back, placed in idle ranges; resynchronisations."""
    return _set(pool, 0)


def plan_from_env(environ: dict[str, str] | None = None) -> Plan | None:
    """The plan named by $NPU_POOL_PLAN (for the device install code), or None when unset."""
    path = (os.environ if environ is None else environ).get(ENV, "")
    return load_plan(path) if path else None
