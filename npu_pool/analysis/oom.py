"""OOM snapshots: what the pool held when a request failed, and what would have helped.

:func:`explain_oom` tells the two kinds of failure apart from the pool's counters:

- **fragmentation**: the pool's free memory (cached free bytes plus what the device
  or the fraction cap still allows) covers the request, but no free block is large
  enough -- reserved - allocated >= request while the largest free block < request
  is the classic sign (MindSpeed's rule of thumb: reserved - allocated > 1 GiB in
  an OOM message). Levers: the ``npu_pool`` policy, ``empty_cache()`` at phase
  boundaries, expandable segments;
- **shortage**: allocated + request exceeds what the pool may hold. Levers (from the
  MindSpeed-MM memory tuning guide): smaller micro-batch with gradient
  accumulation, activation recompute, ZeRO / distributed optimizer / FSDP, offload,
  TP / PP / EP and sequence parallelism, chunked loss; or a higher fraction cap.

:func:`write_oom_snapshot` writes the pool's recent events and block map as JSON
(and a memory_viz-compatible pickle). :func:`on_oom` is the hook ``Pool.malloc``
calls on ``OutOfMemoryError``: when ``NPU_POOL_OOM_SNAPSHOT`` names a directory it
writes a snapshot and returns the text to append to the error; it never raises.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .units import fmt_bytes

__all__ = ["ENV", "OomExplanation", "explain_oom", "write_oom_snapshot", "on_oom"]

ENV = "NPU_POOL_OOM_SNAPSHOT"
_MAX_SNAPSHOTS = 20  # per process: an OOM caught in a loop must not fill the disk
_written = 0

_SHORTAGE_LEVERS = (
    "lower the micro-batch size and raise gradient accumulation (same global batch, fewer activations)",
    "recompute activations (full or selective, e.g. --recompute-granularity full --recompute-method block)",
    "shard static memory over data parallelism: distributed optimizer / ZeRO-1/2 "
    "(--use-distributed-optimizer), FSDP / ZeRO-3 for weights too",
    "offload what the current step does not use: optimizer states and weights to host (FSDP offload_to_cpu), "
    "activation offload",
    "split the model: tensor / pipeline parallelism (expert parallelism for MoE), sequence parallelism "
    "(TP-SP, Ulysses, ring) for long sequences",
    "compute the loss in chunks when the vocabulary and sequence are large",
)


@dataclass
class OomExplanation:
    """Why a request of ``request`` bytes failed and what would have helped."""

    policy: str
    request: int
    reserved: int
    allocated: int
    largest_free: int
    limit: int
    device_total: int
    kind: str  # "fragmentation" or "shortage"
    suggestions: list[str] = field(default_factory=list)

    @property
    def cached_free(self) -> int:
        """Reserved bytes not in allocated blocks."""
        return max(0, self.reserved - self.allocated)

    @property
    def headroom(self) -> int:
        """Bytes the pool could still use in total: cached free plus what the cap allows beyond reserved."""
        return max(0, self.limit - self.allocated)

    def summary(self) -> str:
        """One paragraph: the figures, the diagnosis and the levers."""
        head = (f"request {fmt_bytes(self.request)} on policy {self.policy}: reserved {fmt_bytes(self.reserved)}, "
                f"allocated {fmt_bytes(self.allocated)}, largest free block {fmt_bytes(self.largest_free)}, "
                f"limit {fmt_bytes(self.limit)} of {fmt_bytes(self.device_total)}. ")
        if self.kind == "fragmentation":
            why = (f"Fragmentation: {fmt_bytes(self.headroom)} would be free in total "
                   f"({fmt_bytes(self.cached_free)} cached in the pool) but no block fits the request.")
        else:
            why = (f"Real shortage: {fmt_bytes(self.request - self.headroom)} more than the pool may hold "
                   f"even with no fragmentation.")
        return head + why + " Try: " + "; ".join(self.suggestions) + "."

    def as_dict(self) -> dict[str, Any]:
        return dict(asdict(self), cached_free=self.cached_free, headroom=self.headroom, text=self.summary())


def explain_oom(pool: Any, request: int) -> OomExplanation:
    """Diagnose a failed request of ``request`` bytes from ``pool.stats()``."""
    st = pool.stats()
    reserved = int(st["total"]["reserved"]["current"])
    allocated = int(st["total"]["allocated"]["current"])
    limit, total = int(st.get("limit", 0)), int(st.get("device_total", 0))
    largest = int(st.get("largest_free", 0))
    policy = str(st.get("policy", getattr(pool, "policy", "?")))
    headroom = max(0, limit - allocated)
    frag = headroom >= request and largest < request
    tips: list[str] = []
    if frag:
        if policy != "npu_pool":
            tips.append("use the npu_pool policy (one arena, long- and short-lived tensors placed apart)")
        tips.append("call empty_cache() at phase boundaries (after evaluation, between iterations) to return "
                    "cached free memory")
        if policy == "torch":
            tips.append("expandable segments (policy 'expandable', or PYTORCH_CUDA_ALLOC_CONF="
                        "expandable_segments:True) so freed ranges grow back together")
    else:
        tips.extend(_SHORTAGE_LEVERS)
        if total and limit < total:
            tips.append(f"raise the memory fraction cap ({limit / total:.0%} of the device) if the rest is not "
                        "needed, e.g. by collective-communication buffers")
    return OomExplanation(policy, int(request), reserved, allocated, largest, limit, total,
                          "fragmentation" if frag else "shortage", tips)


def _recent(pool: Any) -> tuple[list[dict[str, Any]], str | None]:
    fn = getattr(pool, "recent_events", None)
    if fn is None:
        return [], "this build's Pool has no recent_events()"
    try:
        return list(fn()), None
    except Exception as e:  # an old core without the ring: keep the rest of the snapshot
        return [], f"recent_events() failed: {e}"


def _vmm_ranges(blocks: list[dict[str, Any]], policy: str) -> list[tuple[int, int]] | None:
    """Reserved ranges for a memory_viz view: None (whole segments) unless memory is mapped piece by piece."""
    from .simulate import PAGE, merge_ranges

    if policy == "torch" or not blocks:
        return None
    if policy == "expandable":
        ivs = merge_ranges((b["addr"], b["addr"] + b["size"]) for b in blocks if b["mapped"])
    else:  # npu_pool: at least the pages under allocated blocks are mapped
        ivs = merge_ranges((b["addr"] // PAGE * PAGE, -(-(b["addr"] + b["size"]) // PAGE) * PAGE)
                     for b in blocks if b["allocated"])
    return [(s, e - s) for s, e in ivs]


def _memviz(policy: str, vmm: bool, blocks: list[dict[str, Any]], events: list[dict[str, Any]], request: int,
            stream: int, device_free: int) -> dict[str, Any]:
    from .memviz import blocks_to_segments

    segs = blocks_to_segments(blocks, _vmm_ranges(blocks, policy) if vmm else None, 0, policy=policy)
    trace: list[dict[str, Any]] = []
    for e in events:
        base = {"addr": int(e["addr"]), "size": int(e["size"]), "stream": int(e["stream"]),
                "time_us": int(e["seq"]), "frames": []}
        if e["kind"] == "alloc":
            trace.append(dict(base, action="alloc"))
        elif e["kind"] == "free":
            trace += [dict(base, action="free_requested"), dict(base, action="free_completed")]
        elif e["kind"] == "oom":
            trace.append(dict(base, action="oom", device_free=device_free))
    if not trace or trace[-1]["action"] != "oom":
        trace.append({"action": "oom", "addr": 0, "size": int(request), "stream": int(stream),
                      "time_us": len(events), "frames": [], "device_free": device_free})
    return {"segments": segs, "device_traces": [trace], "allocator_settings": {"npu_pool_policy": policy}}


def write_oom_snapshot(pool: Any, request_size: int, directory: str | Path, *, stream: int = 0,
                       explanation: OomExplanation | None = None) -> Path:
    """Write ``npu_pool_oom_<pid>_<time>.json`` (and ``.pickle`` for memory_viz) into ``directory``.

    The JSON holds the request, the explanation, the pool's counters, its block map
    and its recent events; returns its path. Raises OSError if the directory cannot
    be created or written.
    """
    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise NotADirectoryError(f"{d} exists and is not a directory")
    d.mkdir(parents=True, exist_ok=True)
    exp = explanation or explain_oom(pool, request_size)
    stats = pool.stats()
    blocks = pool.blocks()
    events, note = _recent(pool)
    stem = f"npu_pool_oom_{os.getpid()}_{time.strftime('%Y%m%d-%H%M%S')}_{time.monotonic_ns() % 1_000_000:06d}"
    doc = {"format": "npu_pool.oom/1", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "pid": os.getpid(),
           "policy": getattr(pool, "policy", None), "request_bytes": int(request_size), "stream": stream,
           "explanation": exp.as_dict(), "stats": stats, "blocks": blocks, "recent_events": events}
    if note:
        doc["recent_events_note"] = note
    path = d / f"{stem}.json"
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    try:
        from .memviz import write_snapshot

        free = max(0, exp.limit - exp.reserved)
        policy = str(stats.get("policy", getattr(pool, "policy", "torch")))
        vmm = policy != "torch" and bool(stats.get("vmm"))
        write_snapshot(_memviz(policy, vmm, blocks, events, request_size, stream, free), d / f"{stem}.pickle")
    except Exception:  # the pickle is a convenience; the JSON is the snapshot
        pass
    return path


def on_oom(pool: Any, size: int, error: BaseException | None = None) -> str | None:
    """Hook for ``Pool.malloc`` on OutOfMemoryError: text to append to the error, or None.

    Does nothing (None) unless ``NPU_POOL_OOM_SNAPSHOT`` is set. Never raises: a
    directory that cannot be written gives a message saying so (and still the
    explanation), so the caller's OutOfMemoryError is raised as it would have been.
    """
    directory = os.environ.get(ENV, "").strip()
    if not directory:
        return None
    global _written
    try:
        exp: OomExplanation | None = explain_oom(pool, size)
    except Exception:
        exp = None
    why = f" {exp.summary()}" if exp else ""
    if _written >= _MAX_SNAPSHOTS:
        return f"[{ENV}] not written: {_MAX_SNAPSHOTS} OOM snapshots already written by this process.{why}"
    try:
        path = write_oom_snapshot(pool, size, directory, explanation=exp)
    except Exception as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        return f"[{ENV}={directory!r}] cannot write the OOM snapshot: {reason}.{why}"
    _written += 1
    return f"[{ENV}] OOM snapshot written to {path}.{why}"
