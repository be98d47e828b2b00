"""Is a plan better than not planning? Replays the trace it was made from (the C loop) under
the planned policy with the plan and under the online npu_pool policy, and says whether the
plan is ever worse: more memory reserved, or a failure or more release-and-retry events on a
device no larger than the online pool needed. A plan of a whole trace (one recorded step) is
a loop no recording shows: it is compared on the step made twice more as well (:mod:`.onward`),
where a run that goes on spends its time.

The planned policy without a plan is the online pool (its fallback arena is npu_pool's
arena), so a plan that would be worse is kept as *online*: installing it installs nothing,
and the planned policy serves every request online."""
from __future__ import annotations

from typing import Any

from ..replay import TraceTooLarge, run, too_large
from ..trace.format import Trace, TraceError, device_type
from ..trace.stats import device_requests
from .onward import onward
from .plan import ONLINE, Plan

__all__ = ["compare_online", "ONLINE", "ONWARD_PASSES"]

ONWARD_PASSES = 2  # the recorded step made again this often: a first step's plan shows its loss from the third on


def compare_online(trace: Trace, plan: Plan, name: str = "the trace") -> dict[str, Any]:
    """Figures of ``plan`` against the online pool on ``trace`` (and, for a plan of the whole
    trace, on it made ONWARD_PASSES more times: ``onward_*``); ``worse`` names what is worse
    (empty when the plan is never worse). TraceTooLarge when the online pool cannot replay it on
    the simulated device."""
    out = _compare(trace, plan, name, "")
    if plan.meta.get("method") != "whole":
        return out
    asked = device_requests(trace, device_type(trace))  # (tensors match by the bytes the device is asked for)
    later = onward(trace, ONWARD_PASSES, asked.size)
    try:
        later.validate(name)
        more = _compare(later, plan, name,
                        f"with the recorded step made {ONWARD_PASSES} more times, as a run that goes on makes it")
    except TraceTooLarge:  # the step alone decides
        out["onward_skipped"] = "the recorded step made again needs more than the simulated 1 TiB device"
        return out
    except TraceError as e:  # (e.g. a step that leaves a tag paused)
        out["onward_skipped"] = f"the recorded step cannot be made again as it was recorded; its repeat: {e}"
        return out
    out["worse"] += more["worse"]
    out.update({f"onward_{k}": v for k, v in more.items() if k != "worse"}, onward_passes=ONWARD_PASSES)
    return out


def _compare(trace: Trace, plan: Plan, name: str, where: str) -> dict[str, Any]:
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
    if where and worse:
        worse = [f"{where}: {', '.join(worse)}"]
    return {"planned_reserved_bytes": planned.peak_reserved_bytes, "online_reserved_bytes": online.peak_reserved_bytes,
            "plan_counts": planned.stats.get("plan", {}), "worse": worse}
