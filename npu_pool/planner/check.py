"""Is a plan better than not planning? Replays the trace it was made from (the C loop) under
the planned policy with the plan and under the online npu_pool policy, and says whether the
plan is ever worse: more memory reserved, or a failure or more release-and-retry events on a
device no larger than the online pool needed.

The planned policy without a plan is the online pool (its fallback arena is npu_pool's
arena), so a plan that would be worse is kept as *online*: installing it installs nothing,
and the planned policy serves every request online."""
from __future__ import annotations

from typing import Any

from ..replay import run, too_large
from ..trace.format import Trace
from .plan import ONLINE, Plan

__all__ = ["compare_online", "ONLINE"]


def compare_online(trace: Trace, plan: Plan, name: str = "the trace") -> dict[str, Any]:
    """Figures of ``plan`` against the online pool on ``trace``; ``worse`` names what is worse
    (empty when the plan is never worse). TraceTooLarge when the online pool cannot replay it on
    the simulated device."""
    online = run(trace, "npu_pool")
    if not online.ok:  # (no device it fits on to compare the plan on)
        raise too_large(trace, name, "npu_pool", online)
    planned = run(trace, "planned", plan=plan)
    tight = online.peak_reserved_bytes  # the device the online pool needs
    planned_tight = run(trace, "planned", tight, plan=plan)
    online_tight = run(trace, "npu_pool", tight)
    worse = []
    gib = lambda b: f"{b / (1 << 30):.3f} GiB"  # noqa: E731
    if planned.peak_reserved_bytes > online.peak_reserved_bytes:
        worse.append(f"reserves {gib(planned.peak_reserved_bytes)}, the online pool {gib(online.peak_reserved_bytes)}")
    if not planned_tight.ok:
        worse.append(f"fails on the {gib(tight)} device the online pool needs")
    elif planned_tight.retries > online_tight.retries:
        worse.append(f"needs {planned_tight.retries} release-and-retry events on the {gib(tight)} device the online "
                     f"pool needs ({online_tight.retries} online)")
    return {"planned_reserved_bytes": planned.peak_reserved_bytes, "online_reserved_bytes": online.peak_reserved_bytes,
            "plan_counts": planned.stats.get("plan", {}), "worse": worse}
