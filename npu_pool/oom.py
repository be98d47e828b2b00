"""What a failed request leaves behind: why it failed, what would help, and (when asked) a
snapshot on disk.

Why is the core's own account (the ``oom`` event of :meth:`Pool.history`, the same one its
error message gives): **too large** (the request alone needs more than the cap),
**fragmentation** (the pool's free memory plus what the cap still allows would cover it,
but not in one piece -- MindSpeed's rule of thumb is reserved - allocated > 1 GiB in an OOM
message) or a real **shortage**. The levers follow the MindSpeed-MM memory tuning guide.

Snapshots: ``NPU_POOL_OOM_SNAPSHOT=DIR``, or torch_npu's ``OOM_SNAPSHOT_ENABLE=1`` (or 2) with
``OOM_SNAPSHOT_PATH=DIR`` (default: the working directory; the switch MindSpeed-MM documents),
make every failed request write ``oom_snapshot_<host>_<pid>_dev<device>_<time>_<n>.pickle`` (for
https://pytorch.org/memory_viz: the pool's segments and its latest :data:`HISTORY_WRITTEN` events
up to the failure) and a compact ``.json`` beside it (explanation, statistics, the first
:data:`BLOCKS_IN_JSON` blocks and the last :data:`HISTORY_IN_JSON` events; the pickle holds the rest), at most
:data:`MAX_SNAPSHOTS` per process, each file whole or absent. The cost of a failure is bounded:
with the switch on, the installed pool keeps :data:`HISTORY_WHEN_ENABLED` events per device (what a
snapshot writes), so a snapshot takes a bounded time however long the run
(``benchmarks/oom_snapshot.py`` measures the time from the failing request to its exception).
:func:`on_oom` is what :meth:`Pool.malloc` and the installed device allocator call; it never raises.

Imports nothing above the vocabulary (and byte formatting): the pool is any object with ``stats()``, ``blocks()``,
``mapped_ranges()`` and ``history()``.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from . import outputs, snapshot
from .locks import ForkSafeLock
from .units import fmt_bytes
from .vocab import OOM_REASONS, STREAM_TAGS

__all__ = ["ENV", "ENABLE", "PATH", "HISTORY_WHEN_ENABLED", "HISTORY_WRITTEN", "OomExplanation", "explain",
           "snapshot_dir", "snapshot_setting", "write_snapshot", "on_oom"]

ENV = "NPU_POOL_OOM_SNAPSHOT"
ENABLE = "OOM_SNAPSHOT_ENABLE"   # MindSpeed-MM's switch ...
PATH = "OOM_SNAPSHOT_PATH"       # ... and directory
MAX_SNAPSHOTS = 20               # per process: an OOM caught in a loop must not fill the disk
HISTORY_WRITTEN = 1 << 15        # latest events a snapshot's pickle holds: bounds the time a failure takes
HISTORY_WHEN_ENABLED = HISTORY_WRITTEN  # events kept per device when OOM snapshots are on (64 bytes each)
HISTORY_IN_JSON = 64             # the events around the failure, in the .json
# the core's tags of free memory as the .json writes a block's or an event's stream: no stream, and no integer
# a JSON reader would round (JavaScript's numbers hold 53 bits)
_STREAM_NAMES = dict(zip(STREAM_TAGS, ("any", "mixed")))
BLOCKS_IN_JSON = 4096            # blocks listed in the .json (the pickle's segments hold all of them)
_written = 0
_numbers = itertools.count()  # the <n> of snapshot names: in the order this process writes them
_lock = ForkSafeLock()


def _forked() -> None:
    """A forked child is a process of its own: its snapshots count from none (with the parent's
    count, a child of a parent that wrote MAX_SNAPSHOTS wrote none)."""
    global _written, _numbers
    _written, _numbers = 0, itertools.count()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)

_UNKNOWN = (1 << 64) - 1  # UINT64_MAX: an oom event's device_free the device did not say, its compactable not counted
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
    """Why a request of ``request`` bytes failed, and what would have helped."""

    policy: str
    pool: str                # the pool the request was for ("arena": memory both pools share)
    request: int
    reserved: int
    allocated: int
    largest_free: int
    limit: int
    device_total: int
    room: Optional[int]      # bytes the cap still allowed reserving; "device": the device's free bytes
                             # (None: the device did not say)
    kind: str                # "too_large", "fragmentation", "shortage" or "device"
    suggestions: list[str] = field(default_factory=list)
    reserved_at_failure: Optional[int] = None  # the pool's reserved bytes when it failed (from its event)
    paused: int = 0          # of the allocated, bytes in paused regions (no memory behind them)
    resume: bool = False     # a paused region's resume failed (its blocks go back at their own addresses)

    @property
    def cached_free(self) -> int:
        """Reserved bytes not in allocated blocks (paused ones hold none)."""
        return max(0, self.reserved - (self.allocated - self.paused))

    @property
    def held_outside(self) -> Optional[int]:
        """For a "device" failure: the device's bytes neither free nor this pool's when it failed
        (None when the device did not say what it had free); 0 for the other kinds."""
        if self.kind != "device":
            return 0
        if self.room is None:
            return None
        pool = self.reserved if self.reserved_at_failure is None else self.reserved_at_failure
        return max(0, self.device_total - self.room - pool)

    def summary(self) -> str:
        """One paragraph: the figures, the diagnosis and the levers."""
        # (an arena's free block counts the pages the cap still lets it map: then more than it holds)
        unmapped = " (with pages the cap still allows mapping)" if self.largest_free > self.cached_free else ""
        head = (f"request {fmt_bytes(self.request)} on policy {self.policy} ({self.pool}): reserved "
                f"{fmt_bytes(self.reserved)}, allocated {fmt_bytes(self.allocated)}, largest free block "
                f"{fmt_bytes(self.largest_free)}{unmapped}, cap {fmt_bytes(self.limit)} of "
                f"{fmt_bytes(self.device_total)}. ")
        why = {"too_large": "The request alone needs more than the whole cap.",
               "fragmentation": (f"Fragmentation: {fmt_bytes(self.cached_free)} cached free in the pool and "
                                 f"{fmt_bytes(self.room or 0)} more under the cap, but no free block fits the request."
                                 if not self.resume else
                                 f"Fragmentation: the resume maps its blocks again at their own addresses and the "
                                 f"cap had room for {fmt_bytes(self.room or 0)} of them; {fmt_bytes(self.cached_free)} "
                                 "is free in the pool's other arenas, kept mapped by their live tensors."),
               "shortage": "A real shortage: the pool cannot hold it even without fragmentation.",
               "device": (f"The device refused memory the cap allows: it had {fmt_bytes(self.room)} free, and "
                          f"{fmt_bytes(self.held_outside or 0)} of it is held outside this pool (other processes, "
                          "collective-communication buffers, another allocator)." if self.room is not None else
                          "The device refused memory the cap allows (it did not say how much it had free): memory "
                          "outside this pool (other processes, collective-communication buffers, another "
                          "allocator) holds the rest of it.")}[self.kind]
        return head + why + " Try: " + "; ".join(self.suggestions) + "."

    def as_dict(self) -> dict[str, Any]:
        return dict(asdict(self), cached_free=self.cached_free, held_outside=self.held_outside, text=self.summary())


def _last_oom(events: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    return next((e for e in reversed(events) if e["kind"] == "oom"), None)


def explain(pool: Any, request: Optional[int] = None) -> OomExplanation:
    """The latest failed request of ``pool`` explained (``request``: its size, when the history
    kept no ``oom`` event; the diagnosis then comes from the counters alone)."""
    if request is not None and (isinstance(request, bool) or not isinstance(request, int) or request < 1):
        raise ValueError(f"request must be a size in bytes (an int >= 1) or None, got {request!r:.40}")
    st = pool.stats()
    ev = _last_oom(pool.history(HISTORY_IN_JSON))
    reserved, allocated = int(st["total"]["reserved"]["current"]), int(st["total"]["allocated"]["current"])
    limit, total, largest = int(st["limit"]), int(st["device_total"]), int(st["largest_free"])
    paused = int(st["paused"])
    names = list(st["pools"])
    at_failure: Optional[int] = None
    resume = False  # (a resume's failure: its event's stream is the tag no request may use)
    compactable: Optional[int] = None  # what a compaction would give back, where the failure said it
    room: Optional[int]
    if ev is not None and (request is None or request == ev["size"]):
        request, kind = int(ev["size"]), OOM_REASONS[ev["detail"]]
        resume = ev["stream"] == STREAM_TAGS[0]
        compactable = None if ev["compactable"] == _UNKNOWN else int(ev["compactable"])  # (not counted: a restore's)
        room, pool_name = int(ev["device_free"]), names[ev["pool"]] if ev["pool"] < len(names) else "arena"
        at_failure = int(ev["addr"])
        if room == _UNKNOWN:
            room = None
    else:
        request = int(request or 0)
        room, pool_name = max(0, limit - reserved), "arena"
        kind = "too_large" if request > limit else "fragmentation" if limit - allocated >= request else "shortage"
    tips: list[str] = []
    policy = str(st["policy"])
    if kind == "device":  # no setting of this pool helps: the memory is elsewhere
        tips.append("see what else holds this device (nvidia-smi / npu-smi list the processes) and free it, or "
                    "give the others less (their own memory settings: a colocated engine's memory fraction, "
                    "collective-communication buffer sizes)")
        tips.append("or hold less at once: " + _SHORTAGE_LEVERS[0])
        return OomExplanation(policy, pool_name, request, reserved, allocated, largest, limit, total, room, kind, tips,
                              at_failure, paused, resume)
    if total and limit < total:  # first: the one lever that needs no change to the model (and may be cut last)
        tips.append(f"raise the memory fraction cap ({limit / total:.0%} of the device) if the rest is not "
                    "needed, e.g. by collective-communication buffers")
    idle = _idle_elsewhere(pool, st, resume) if policy == "npu_pool" and kind == "fragmentation" else {}
    if idle:  # (each arena keeps its chunks around its live tensors)
        tips.append("free the tensors that keep the pool's other arenas mapped, or pause those regions: empty_cache "
                    "cannot return their free memory (" + ", ".join(f"{t}: {fmt_bytes(b)}" for t, b in
                                                            sorted(idle.items(), key=lambda x: -x[1])[:4]) + ")")
    if kind == "fragmentation" and policy in ("npu_pool", "planned"):
        # (its failed request already returned every wholly free chunk and retried: empty_cache frees nothing more)
        if policy == "planned":
            tips.append("plan again from a trace of this run (`npu-pool plan TRACE`): what the plan does not place "
                        "goes to its npu_pool fallback (docs/planner.md)")
        elif not pool.tags():  # (the planned policy has no regions to pause)
            tips.append("plan the steady iteration (`npu-pool plan TRACE`, then NPU_POOL_POLICY=planned): every "
                        "tensor at a fixed offset, the free memory in one piece (docs/planner.md)")
        # (on, the failed request compacted already; the failure's own figure 0: nothing to give back)
        if st["compactable"] and not st["compaction"] and compactable != 0:
            figure = f"{fmt_bytes(compactable)} of " if compactable else ""
            tips.append(f"or move live tensors' bytes to give back the {figure}free pages their chunks keep mapped: "
                        "npu_pool.compact() where no other thread queues device work, or NPU_POOL_COMPACT=1 at "
                        "every out-of-memory (docs/api.md, Compaction)")
        tips.append("or hold less at once: " + _SHORTAGE_LEVERS[0])
    elif kind == "fragmentation":
        tips.append("use the npu_pool policy (one arena, long- and short-lived tensors placed apart)")
        tips.append("call empty_cache() at phase boundaries (after evaluation, between iterations) to return "
                    "cached free memory")
    else:
        tips.extend(_SHORTAGE_LEVERS)
    return OomExplanation(policy, pool_name, request, reserved, allocated, largest, limit, total, room, kind, tips,
                          at_failure, paused, resume)


def _idle_elsewhere(pool: Any, st: dict[str, Any], resume: bool = False) -> dict[str, int]:
    """Free bytes mapped in the arenas other than the current region's (a resume's failure: in
    every arena, the current one too), by name ("untagged": the main arena's), where some are; {}
    when the pool has no tags."""
    tags = pool.tags()
    if not tags:
        return {}
    current = [t for t, v in tags.items() if v["current"] and not resume]
    idle = {t: v["mapped"] - v["allocated"] for t, v in tags.items() if t not in current}
    untagged = (int(st["total"]["reserved"]["current"]) - sum(v["mapped"] for v in tags.values())) - \
        (int(st["total"]["allocated"]["current"]) - sum(v["allocated"] for v in tags.values()))
    if current or resume:  # (a request outside every region is the main arena's own: not elsewhere)
        idle["untagged"] = untagged
    return {t: b for t, b in idle.items() if b > 0}


def snapshot_dir(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Where OOM snapshots go: ``NPU_POOL_OOM_SNAPSHOT``, else ``OOM_SNAPSHOT_PATH`` (or the working
    directory) when ``OOM_SNAPSHOT_ENABLE`` is 1 or 2 (torch_npu's values); None when neither asks
    for them."""
    setting = snapshot_setting(environ)
    return setting[0] if setting else None


def snapshot_setting(environ: Optional[Mapping[str, str]] = None) -> Optional[tuple[str, str]]:
    """:func:`snapshot_dir` and the variable it comes from (for messages), or None."""
    env = os.environ if environ is None else environ
    direct = env.get(ENV, "").strip()
    if direct:
        return direct, ENV
    if env.get(ENABLE, "").strip() in ("1", "2", "true", "True"):  # torch_npu's 1 and 2 (2: the state without
        # the history, where npu_pool writes both)
        return env.get(PATH, "").strip() or ".", PATH
    return None


def _named(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Blocks or events with the core's tags of free memory named (:data:`_STREAM_NAMES`), and an
    event's figures the core did not count (UINT64_MAX) null."""
    return [dict(r, stream=_STREAM_NAMES.get(r["stream"], r["stream"]),
                 **{k: None for k in ("device_free", "compactable") if r.get(k) == _UNKNOWN}) for r in rows]


def write_snapshot(pool: Any, directory: str | Path, *, device: int = 0,
                   explanation: Optional[OomExplanation] = None) -> Path:
    """Write ``oom_snapshot_<host>_<pid>_dev<device>_<time>_<n>.pickle`` and ``.json`` into ``directory``, each
    whole or absent; returns the pickle's path. Raises OSError if the directory cannot be made
    or written, :class:`HalfWritten` when the pickle was written and the .json was not."""
    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise NotADirectoryError(f"{d} exists and is not a directory")
    d.mkdir(parents=True, exist_ok=True)
    exp = explanation or explain(pool)
    host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:40] or "host"
    while True:  # (ranks in containers of one host name may share a pid and a second: skip a name taken)
        stem = f"oom_snapshot_{host}_{os.getpid()}_dev{device}_{time.strftime('%Y%m%d-%H%M%S')}_{next(_numbers):04d}"
        if not (d / f"{stem}.pickle").exists() and not (d / f"{stem}.json").exists():
            break
    view = pool.view(HISTORY_WRITTEN)  # the pickle and the .json: one reading (other threads may allocate)
    pickle_path = snapshot.write(snapshot.pool_snapshot({device: pool}, views={device: view}), d / f"{stem}.pickle")
    history = _named(view.history[-HISTORY_IN_JSON:])
    doc = {"format": "npu_pool.oom/6", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "pid": os.getpid(),
           "device": device, "snapshot": pickle_path.name, "explanation": exp.as_dict(), "stats": view.stats,
           "blocks": _named(view.blocks[:BLOCKS_IN_JSON]), "blocks_total": len(view.blocks), "history": history}
    try:
        outputs.write_text(d / f"{stem}.json", json.dumps(doc, separators=(",", ":"), default=str))
    except OSError as e:
        raise HalfWritten(pickle_path, e.strerror or str(e)) from e
    return pickle_path


class HalfWritten(Exception):
    """The snapshot's pickle was written (``path``), its .json explanation was not (``reason``)."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path} written, but not its .json explanation: {reason}")
        self.path, self.reason = path, reason

    def __reduce__(self) -> tuple:
        return HalfWritten, (self.path, self.reason)


def on_oom(pool: Any, size: int, device: int = 0) -> Optional[str]:
    """After ``pool`` failed a request of ``size`` bytes: write a snapshot when asked for; returns
    the text to add to the error (None when no snapshot was asked for). Never raises."""
    global _written
    directory = snapshot_dir()
    if not directory:
        return None
    try:
        exp: Optional[OomExplanation] = explain(pool, size)
    except Exception:  # a broken pool must not hide the caller's error
        exp = None
    why = f" {exp.summary()}" if exp else ""
    with _lock:
        if _written >= MAX_SNAPSHOTS:
            return f"[OOM snapshot] not written: {MAX_SNAPSHOTS} already written by this process.{why}"
        _written += 1  # (a slot taken now, so that threads failing at once write no more than the bound)
    try:
        path = write_snapshot(pool, directory, device=device, explanation=exp)
    except HalfWritten as e:
        return f"[OOM snapshot] written to {e.path}, but not its .json explanation: {e.reason}.{why}"
    except Exception as e:
        with _lock:
            _written -= 1  # nothing written: the slot is free again (a full disk may have room later)
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        return f"[OOM snapshot] cannot write to {directory!r}: {reason}.{why}"
    return f"[OOM snapshot] written to {path} (open it at https://pytorch.org/memory_viz).{why}"
