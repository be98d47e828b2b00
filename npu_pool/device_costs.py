"""What device calls cost in time: a per-call cost table and the estimate it gives.

A replay counts device calls by kind (``vocab.CALL_NAMES``); multiplied by a cost per call they
give an estimated device time: the stalls a real card would add on the host's side. Each figure
carries its source. The defaults are stated assumptions (orders of magnitude), not measurements
of a given card: measure yours and pass them as a JSON file ``{"map": 40.0, ...}`` (microseconds
per call; kinds left out keep the default) to ``npu-pool replay --costs FILE`` or
``benchmarks/device_calls.py --costs FILE``.
"""
from __future__ import annotations

import json
from typing import Mapping

from .config import show
from .inputs import NotRegularFile, open_regular
from .vocab import CALL_NAMES

__all__ = ["DEFAULT_COSTS", "load_costs", "estimate_us", "physical_calls"]

_MAX_BYTES = 1 << 20  # a cost table is a few hundred bytes
_MAX_US = 1e9  # no memory call takes a quarter of an hour: a larger figure is a mistake (and 1e308 sums to inf)
_ASSUMED = "assumed order of magnitude (no public per-call measurement on record here); override with --costs"
_SYNC = ("assumed: the host-side cost of a call that waits for the device to drain; the queued work "
         "itself is not counted (it depends on the model)")

# kind -> (microseconds per call, source)
DEFAULT_COSTS: dict[str, tuple[float, str]] = {
    "malloc": (500.0, "assumed: cudaMalloc / aclrtMalloc of a segment, which the runtime maps page tables for; "
                      "PyTorch caches segments because it is slow (CUDACachingAllocator's notes)"),
    "free": (500.0, "assumed: cudaFree / aclrtFree (cudaFree waits for the device by itself; before "
                    "aclrtFree the caller synchronises once, counted as sync_device)"),
    "reserve": (20.0, _ASSUMED),
    "release": (20.0, _ASSUMED),
    "phys_create": (200.0, "assumed: cuMemCreate / aclrtMallocPhysical take physical memory as cudaMalloc does"),
    "phys_release": (100.0, _ASSUMED),
    "map": (50.0, "assumed: cuMemMap / aclrtMapMem; PyTorch's expandable-segments notes say mapping cost "
                  "grows with the number of physical handles (one per 2 or 20 MiB page)"),
    "unmap": (100.0, "assumed: cuMemUnmap / aclrtUnmapMem change live mappings (device-side TLB work)"),
    "set_access": (50.0, _ASSUMED),
    "sync_device": (100.0, _SYNC),
    "sync_stream": (50.0, _SYNC),
    "event_create": (5.0, _ASSUMED),
    "event_record": (5.0, _ASSUMED),
    "event_wait": (5.0, _ASSUMED),
    "event_destroy": (5.0, _ASSUMED),
    "stream_query": (2.0, _ASSUMED),
    "get_device": (0.5, _ASSUMED),
    "set_device": (1.0, _ASSUMED),
    "mem_info": (10.0, _ASSUMED),
    "granularity": (1.0, _ASSUMED),
}
assert set(DEFAULT_COSTS) == set(CALL_NAMES), "a cost for every call kind of the vocabulary"


def load_costs(path: str | None) -> dict[str, tuple[float, str]]:
    """The default table, with the costs of a JSON file ``{kind: microseconds}`` over it.
    ValueError with a one-line message for an unreadable file, an unknown kind or a bad number."""
    costs = dict(DEFAULT_COSTS)
    if not path:
        return costs
    try:
        with open_regular(path) as f:  # (a FIFO must not block)
            raw = f.read(_MAX_BYTES + 1)
        if len(raw) > _MAX_BYTES:
            raise ValueError(f"more than {_MAX_BYTES} bytes; not a cost table")
        given = json.loads(raw)
    except NotRegularFile as e:
        raise ValueError(f"cost table {path}: not a regular file ({e.kind}); name a JSON file") from None
    except OSError as e:
        raise ValueError(f"cost table {path}: cannot read ({e.strerror or e})") from None
    except ValueError as e:
        raise ValueError(f"cost table {path}: {e}") from None
    except RecursionError:
        raise ValueError(f"cost table {path}: nested too deeply; expected an object {{kind: microseconds}}") from None
    if not isinstance(given, dict):
        raise ValueError(f"cost table {path}: expected an object {{kind: microseconds}}")
    for kind, us in given.items():
        if kind not in costs:
            raise ValueError(f"cost table {path}: unknown call kind {show(kind)}; kinds: {', '.join(CALL_NAMES)}")
        if isinstance(us, bool) or not isinstance(us, (int, float)) or not 0 <= us <= _MAX_US:  # (False for NaN)
            raise ValueError(f"cost table {path}: {kind} must be a number of microseconds from 0 to {_MAX_US:g}, "
                             f"got {show(us)}")
        costs[kind] = (float(us), f"given in {path}")
    return costs


def estimate_us(calls: Mapping[str, int], costs: Mapping[str, tuple[float, str]] | None = None) -> float:
    """Estimated device time of ``calls`` (microseconds)."""
    table = DEFAULT_COSTS if costs is None else costs
    return sum(n * table[k][0] for k, n in calls.items())


def physical_calls(calls: Mapping[str, int]) -> int:
    """Physical memory taken and given back: segments (malloc + free) and chunks (phys_create +
    phys_release), the count issue 19's bound compares across policies."""
    return calls["malloc"] + calls["free"] + calls["phys_create"] + calls["phys_release"]
