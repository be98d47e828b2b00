"""Plans on pools: install one on a ``"planned"`` pool, read its counters, load NPU_POOL_PLAN."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Union

from ..pool import PLAN_COUNTS
from ..trace.format import Trace
from ..trace.stats import alloc_sizes, contains, device_requests, fingerprint
from .plan import ONLINE, Plan, PlanError
from .planfile import load_plan

__all__ = ["COUNTS", "ENV", "as_plan", "install", "remove", "counts", "plan_from_env", "check_made_for", "check_rules"]

COUNTS = PLAN_COUNTS  # np_set_plan's counters, in order
ENV = "NPU_POOL_PLAN"

PlanLike = Union[Plan, str, Path]


def as_plan(plan: PlanLike) -> Plan:
    """``plan`` itself, or the plan file it names."""
    if isinstance(plan, Plan):
        return plan
    loaded = load_plan(plan)
    _files[id(loaded)] = (loaded, str(plan))  # the file, for messages (the plan is kept alive with it)
    while len(_files) > _FILES_KEPT:
        _files.pop(next(iter(_files)))
    return loaded


_files: dict[int, tuple[Plan, str]] = {}  # the plans read last, by id: the file each came from
_FILES_KEPT = 8


def _file_of(plan: Plan) -> str:
    entry = _files.get(id(plan))
    return entry[1] if entry is not None and entry[0] is plan else ""


def check_rules(plan: Plan, rules: str | None, applied: str) -> None:
    """PlanError when ``plan`` was made under other request rules than ``rules`` ("npu" or
    "cuda"; anything else: no check), which the device ``applied`` them (words for the message):
    its sizes never match, every request would miss while the region is held."""
    made = plan.meta.get("device", "cuda")  # plans before device rules were made unpadded
    if rules in ("npu", "cuda") and rules != made:
        raise PlanError(f"the plan {_file_of(plan) or ''} was made with {made}'s request rules and {applied} "
                        f"{rules}'s: its sizes never match; make it with `npu-pool plan TRACE --device {rules}`")


def check_made_for(plan: Plan, trace: Trace, name: str = "the trace", device: str | None = None) -> None:
    """PlanError unless ``trace`` runs the iteration ``plan`` was made for: its allocation sizes
    hold the plan's loop body, in order. (A run may differ from the planned trace in the ways a
    plan copes with -- more iterations, an evaluation, a prologue -- but not in its iteration.)"""
    check_rules(plan, device, "would replay under")
    made = plan.meta.get("device", "cuda")
    body = plan.size[plan.loop:]
    if not contains(alloc_sizes(device_requests(trace, made)), body):
        source = plan.meta.get("source") or "another trace"
        if name == trace.meta.get("origin"):  # the caller knows the trace by the origin it records
            name = f"the trace (recorded by {name})"
        which = f"the plan {_file_of(plan)}" if _file_of(plan) else "the plan"
        raise PlanError(f"{which} was made for {source}: its training iteration (the allocation sizes in order, "
                        f"fingerprint {fingerprint(body)}) never runs in {name}. Make a plan from this trace "
                        "itself: `npu-pool plan TRACE --out PLAN`")


def install(pool: Any, plan: PlanLike) -> bool:
    """Install ``plan`` (a Plan or a plan file) on ``pool``, whose policy must be ``"planned"``;
    returns whether it did. A plan the planner found worse than the online pool (``meta["online"]``)
    installs nothing: the planned policy then serves every request online, as npu_pool.
    Install before the first allocation: the region is reserved at the first planned request,
    and the fallback arena (when the device has no virtual-memory API) is sized to leave room."""
    p = as_plan(plan)
    if p.meta.get(ONLINE):
        if getattr(pool, "policy", "planned") != "planned":
            raise PlanError(f"a plan installs on a 'planned' pool; this pool's policy is {pool.policy!r}, not planned")
        return False
    check_rules(p, getattr(pool, "device_rules", None), "this pool applies")
    pool.set_plan(p.size, p.offset, p.end, p.loop, p.region, p.flags, outside=p.outside)
    return True


def remove(pool: Any) -> None:
    """Remove the pool's plan (every request then goes to the fallback)."""
    pool.set_plan([], [], [], 0, 0, 0)


def counts(pool: Any) -> dict[str, int]:
    """Requests served from the plan, fallen back, placed in idle ranges; resynchronisations."""
    return pool.plan_counts()


def plan_from_env(environ: dict[str, str] | None = None) -> Plan | None:
    """The plan named by $NPU_POOL_PLAN (for the device install code), or None when unset."""
    path = (os.environ if environ is None else environ).get(ENV, "")
    return load_plan(path) if path else None
