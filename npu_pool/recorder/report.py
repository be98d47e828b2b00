"""Per-rank memory reports: the per-iteration line, the JSON written at exit, and the
merged table of all ranks (``npu-pool merge``).

A report is a plain dict (``VERSION`` 1)::

    rank, world_size, host, pid, mode ("device": an installed npu_pool allocator;
    "recorder": no device allocator, markers and times only), reason (why "recorder"),
    policy, device, iterations, step_seconds {mean, max, last}, phase_seconds {stage: s},
    marks, host_peak_rss_bytes, final (written as the process exited; false: during training,
    as of then), memory (null in "recorder" mode) {allocated_bytes,
    reserved_bytes, peak_allocated_bytes, peak_reserved_bytes, utilization, pools
    {name: {allocated_bytes, reserved_bytes}}, device_mallocs, device_frees, ooms,
    retries, trims, compactions, compacted (chunks compaction replaced, live bytes it moved)}

``utilization`` is peak allocated / peak reserved: how much of the high-water mark the
program ever used (1.0 = no fragmentation overhead; above 1 in a colocated run, whose paused
tag's tensors stay allocated while their memory is back with the device).
"""
from __future__ import annotations

import json
import math
import os
import resource
import socket
import sys
from pathlib import Path
from typing import Any, Iterable, Optional

from ..inputs import NotRegularFile, open_regular

VERSION = 1
FILE_PATTERN = "npu_pool_rank*.json"
GiB = float(1 << 30)
_MAX_REPORT = 1 << 20  # bytes of one rank report read at most (one is a few KiB; a merge keeps every one it reads)


def memory_of(stats: dict[str, Any]) -> dict[str, Any]:
    """The report's ``memory`` section from :meth:`npu_pool.pool.Pool.stats`."""
    total = stats["total"]
    peak_alloc, peak_rsvd = total["allocated"]["peak"], total["reserved"]["peak"]
    return {
        "allocated_bytes": total["allocated"]["current"],
        "reserved_bytes": total["reserved"]["current"],
        "peak_allocated_bytes": peak_alloc,
        "peak_reserved_bytes": peak_rsvd,
        "utilization": peak_alloc / peak_rsvd if peak_rsvd else 1.0,
        "pools": {name: {"allocated_bytes": p["allocated"]["current"], "reserved_bytes": p["reserved"]["current"]}
                  for name, p in stats.get("pools", {}).items()},
        **{k: stats.get(k, 0) for k in ("device_mallocs", "device_frees", "ooms", "retries", "trims", "compactions",
                                        "compacted")},
    }


def host_peak_rss() -> int:
    """This process's peak resident host memory in bytes (Linux reports KiB)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss) * (1 if sys.platform == "darwin" else 1024)


def rank_and_world() -> tuple[int, Optional[int]]:
    """(rank, world size): torchrun's RANK/WORLD_SIZE, else torch.distributed's, else (0, None):
    a process that is not part of a distributed run has no world size to check reports against."""
    env = os.environ
    rank, world = _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE")
    if world is not None and (world == 0 or (rank is not None and rank >= world)):
        import warnings  # (merge would refuse the report: rank outside its world)

        warnings.warn(f"npu_pool: WORLD_SIZE={world} with RANK={env.get('RANK', '')!r:.20} is no world this rank "
                      "belongs to; the world size is taken as unknown", RuntimeWarning, stacklevel=2)
        world = None
    if rank is not None:
        return rank, world
    dist = getattr(sys.modules.get("torch"), "distributed", None)
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    return 0, None


def _env_int(env: Any, name: str) -> Optional[int]:
    """A whole number from the environment; None when unset or not one (a warning says so:
    the report is still written, under the rank torch.distributed or the default gives)."""
    from ..config import ConfigError, parse_int

    value = env.get(name, "")
    if not value.strip():
        return None
    try:
        return parse_int(value, name, 0, (1 << 31) - 1)
    except ConfigError as e:
        import warnings

        warnings.warn(f"npu_pool: {e}; ignored", RuntimeWarning, stacklevel=3)
        return None


def _gib(b: Optional[float]) -> str:
    return "-" if b is None else f"{b / GiB:.2f}"


def format_line(report: dict[str, Any], iteration: int) -> str:
    """The one-line status of a rank after ``iteration``."""
    head = f"[npu_pool rank {report['rank']}] iter {iteration}"
    step = report["step_seconds"].get("last")
    timing = f" | step {step:.3f} s" if step is not None else ""
    mem = report.get("memory")
    if mem is None:
        return (f"{head}{timing} | host peak RSS {_gib(report['host_peak_rss_bytes'])} GiB | "
                "recorder mode (no device allocator): no device memory figures")
    return (f"{head}{timing} | allocated {_gib(mem['allocated_bytes'])} GiB"
            f" | reserved {_gib(mem['reserved_bytes'])} GiB | peak {_gib(mem['peak_reserved_bytes'])} GiB"
            f" | util {mem['utilization']:.1%} | {_pools(mem)}"
            f" | device mallocs {mem['device_mallocs']}"
            + (f" | compactions {mem['compactions']} ({_gib(mem.get('compacted'))} GiB moved)"
               if mem.get("compactions") else ""))


def _pools(mem: dict[str, Any]) -> str:
    """The pools' part of the line. Pools that hold memory of their own (torch's small/large)
    show allocated/reserved each; pools that share one arena (npu_pool's long/short: the
    arena's bytes belong to no pool) show what each has allocated, and say they share it."""
    pools = mem["pools"]
    own = sum(p["reserved_bytes"] for p in pools.values())
    if mem["reserved_bytes"] and own < mem["reserved_bytes"]:
        return " ".join(f"{n} {_gib(p['allocated_bytes'])}" for n, p in pools.items()) + " GiB allocated (one shared arena)"
    return " ".join(f"{n} {_gib(p['allocated_bytes'])}/{_gib(p['reserved_bytes'])}" for n, p in pools.items()) + \
        " GiB (allocated/reserved)"


def write(report: dict[str, Any], directory: str | os.PathLike[str]) -> Path:
    """Write ``report`` as ``npu_pool_rank<rank>.json`` in ``directory`` (atomically)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"npu_pool_rank{report['rank']}.json"
    from ..outputs import write_text

    return write_text(path, json.dumps(report, indent=1, sort_keys=True))


def load(directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every rank report in ``directory``, by rank; ValueError naming a bad or missing file."""
    d = Path(directory)
    if not d.is_dir():
        raise ValueError(f"{d}: not a directory (expected the NPU_POOL_REPORT_DIR of a run)")
    reports = []
    for path in sorted(d.glob(FILE_PATTERN)):
        try:
            with open_regular(path) as f:  # a FIFO or device named like a report would block forever
                raw = f.read(_MAX_REPORT + 1)
            if len(raw) > _MAX_REPORT:
                raise ValueError(f"more than {_MAX_REPORT} bytes; a rank report is a few KiB")
            r = json.loads(raw)
        except NotRegularFile:
            raise ValueError(f"{path}: not a regular file (expected an npu_pool rank report)") from None
        except RecursionError:
            raise ValueError(f"{path}: not a readable npu_pool rank report (nested too deeply)") from None
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not a readable npu_pool rank report ({str(e)[:160]})") from None
        if not isinstance(r, dict) or type(r.get("version")) is not int or r["version"] != VERSION \
                or not isinstance(r.get("rank"), int):
            raise ValueError(f"{path}: not an npu_pool rank report of version {VERSION}")
        problem = _shape_problem(r)
        if problem:
            raise ValueError(f"{path}: not a valid npu_pool rank report ({problem})")
        named = path.name[len("npu_pool_rank"):-len(".json")]
        if named != str(r["rank"]):  # a renamed or copied report would stand for another rank
            raise ValueError(f"{path}: the report of rank {r['rank']} under another name "
                             f"(a rank writes npu_pool_rank<rank>.json)")
        reports.append(r)
    if not reports:
        raise ValueError(f"{d}: no rank reports ({FILE_PATTERN}); run with NPU_POOL_REPORT_DIR={d}")
    ranks = [r["rank"] for r in reports]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"{d}: two reports for one rank ({sorted(ranks)})")
    return sorted(reports, key=lambda r: r["rank"])


def _number(v: Any) -> bool:
    """A figure of a report: absent, or a number >= 0 (counts, bytes, seconds: none is negative)."""
    return v is None or (not isinstance(v, bool) and isinstance(v, (int, float)) and 0 <= v < 1 << 63)


def _shape_problem(r: dict[str, Any]) -> Optional[str]:
    """What is wrong with the fields the table reads (None: nothing), so that a hand-edited or
    foreign file is refused with its field named instead of failing half-way."""
    if isinstance(r["rank"], bool) or not 0 <= r["rank"] < 1 << 31:
        return "rank should be a whole number >= 0"
    if not (r.get("world_size") is None or (isinstance(r["world_size"], int) and not isinstance(r["world_size"], bool)
                                            and 0 < r["world_size"] < 1 << 31)):
        return "world_size should be a whole number > 0 or null"
    if r.get("world_size") is not None and r["rank"] >= r["world_size"]:
        return f"rank {r['rank']} is outside its world of {r['world_size']} ranks"
    if r.get("mode", "device") not in ("device", "recorder"):
        return "mode should be device or recorder"
    if not isinstance(r.get("final", True), bool):
        return "final should be true or false"
    for key in ("iterations", "host_peak_rss_bytes"):
        if not _number(r.get(key)):
            return f"{key} should be a number >= 0"
    steps = r.get("step_seconds", {})
    if not isinstance(steps, dict):
        return f"step_seconds should be an object, not {type(steps).__name__}"
    if not all(_number(steps.get(k)) for k in ("mean", "max", "last")):
        return "step_seconds values should be numbers >= 0"
    mem = r.get("memory")
    if mem is None:
        return None
    if not isinstance(mem, dict):
        return f"memory should be an object or null, not {type(mem).__name__}"
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "utilization", "device_mallocs", "ooms"):
        if not _number(mem.get(key)):
            return f"memory.{key} should be a number >= 0"
    peak_alloc, peak_rsvd, util = mem.get("peak_allocated_bytes"), mem.get("peak_reserved_bytes"), mem.get("utilization")
    if None not in (peak_alloc, peak_rsvd, util) and \
            not math.isclose(util, peak_alloc / peak_rsvd if peak_rsvd else 1.0, rel_tol=1e-9):
        return (f"memory.utilization is {util:.6g}, but peak allocated / peak reserved is "
                f"{peak_alloc}/{peak_rsvd}: the figures do not add up")
    pools = mem.get("pools", {})
    if not isinstance(pools, dict) or not all(isinstance(p, dict) and _number(p.get("reserved_bytes"))
                                              and _number(p.get("allocated_bytes")) for p in pools.values()):
        return "memory.pools should map pool names to objects with numeric reserved_bytes and allocated_bytes"
    return None


# column title, getter, formatter
_COLUMNS: tuple[tuple[str, Any, Any], ...] = (
    ("iters", lambda r: r.get("iterations"), str),
    ("step s", lambda r: (r.get("step_seconds") or {}).get("mean"), lambda v: f"{v:.3f}"),
    ("peak alloc", lambda r: (r.get("memory") or {}).get("peak_allocated_bytes"), _gib),
    ("peak rsvd", lambda r: (r.get("memory") or {}).get("peak_reserved_bytes"), _gib),
    ("util", lambda r: (r.get("memory") or {}).get("utilization"), lambda v: f"{v:.1%}"),
    ("long", lambda r: ((r.get("memory") or {}).get("pools", {}).get("long") or {}).get("allocated_bytes"), _gib),
    ("short", lambda r: ((r.get("memory") or {}).get("pools", {}).get("short") or {}).get("allocated_bytes"), _gib),
    ("mallocs", lambda r: (r.get("memory") or {}).get("device_mallocs"), str),
    ("ooms", lambda r: (r.get("memory") or {}).get("ooms"), str),
    ("host rss", lambda r: r.get("host_peak_rss_bytes"), _gib),
)
# figures whose spread across ranks the summary reports: title, getter
_SPREAD = (("peak reserved", _COLUMNS[3][1]), ("peak allocated", _COLUMNS[2][1]), ("step time", _COLUMNS[1][1]),
           ("host peak RSS", _COLUMNS[9][1]))


def imbalance(reports: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per figure: min and max with their ranks, mean, and spread = (max - min) / mean."""
    reports = list(reports)
    out = []
    for title, get in _SPREAD:
        vals = [(get(r), r["rank"]) for r in reports if get(r) is not None]
        if len(vals) < 2:
            continue
        lo, hi = min(vals), max(vals)
        mean = sum(v for v, _ in vals) / len(vals)
        out.append({"figure": title, "min": lo[0], "min_rank": lo[1], "max": hi[0], "max_rank": hi[1], "mean": mean,
                    "spread": (hi[0] - lo[0]) / mean if mean else 0.0})
    return out


def _missing_ranks(world: int, ranks: list[int], most: int = 8) -> str:
    """The ranks of [0, world) not in ``ranks``, as ranges, the first ``most`` of them named and the
    rest counted (a world of 2**31 ranks is not listed one by one)."""
    inside = sorted({r for r in ranks if r < world})
    spans, start = [], 0
    for r in inside + [world]:
        if r > start:
            spans.append(str(start) if r == start + 1 else f"{start}-{r - 1}")
        start = r + 1
    missing = world - len(inside)
    more = f", ... ({missing} in all)" if len(spans) > most else ""
    return ", ".join(spans[:most]) + more


def _ranks(ranks: list[int], most: int = 8) -> str:
    """Ranks named, the first ``most`` of them, the rest counted."""
    ranks = sorted(ranks)
    more = f", ... ({len(ranks)} in all)" if len(ranks) > most else ""
    return ", ".join(map(str, ranks[:most])) + more


def merge_table(reports: list[dict[str, Any]]) -> str:
    """All ranks in one table (GiB, seconds), then the imbalance across ranks."""
    head = ["rank", "mode"] + [c[0] for c in _COLUMNS]
    rows = [[str(r["rank"]), r.get("mode", "?")] +
            ["-" if (v := get(r)) is None else fmt(v) for _, get, fmt in _COLUMNS] for r in reports]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    out = [line(head), "  ".join("-" * w for w in widths), *map(line, rows)]
    worlds = {r.get("world_size") for r in reports} - {None}
    if len(worlds) > 1:
        out.append(f"warning: the reports come from runs of different sizes ({sorted(worlds)} ranks)")
    elif worlds and (w := worlds.pop()) > len(reports):
        out.append(f"warning: {len(reports)} reports for a world of {w} ranks (missing: "
                   f"{_missing_ranks(w, [r['rank'] for r in reports])})")
    unfinished = [r["rank"] for r in reports if r.get("final") is False]
    if unfinished:
        out.append(f"warning: no report written at exit by rank {_ranks(unfinished)} (killed by a signal, or still "
                   "running): the figures are as of the last write during training")
    spread = imbalance(reports)
    if spread:
        out.append("")
        out.append("imbalance across ranks (spread = (max - min) / mean):")
        for s in spread:
            fmt = (lambda v: f"{v:.3f} s") if s["figure"] == "step time" else (lambda v: f"{_gib(v)} GiB")
            out.append(f"  {s['figure']:15} max {fmt(s['max'])} on rank {s['max_rank']}, min {fmt(s['min'])} on rank "
                       f"{s['min_rank']}, spread {s['spread']:.1%}")
    modes = {r.get("mode") for r in reports}
    if "recorder" in modes:
        out.append("")
        out.append("mode 'recorder': no device allocator was installed on those ranks (CPU, or no NPU/GPU): "
                   "memory columns are '-'; host RSS and step times are still measured")
    out.append("(GiB unless marked; util = peak allocated / peak reserved; long/short = npu_pool's lifetime "
               "classes, the bytes each has allocated: they share one arena, whose reserved bytes are neither's)")
    return "\n".join(out)


class StepTimes:
    """A run's step times as a report gives them (mean, max, last), in constant memory: a run of a
    million steps is not kept step by step."""

    __slots__ = ("count", "total", "most", "last")

    def __init__(self, seconds: Iterable[float] = ()) -> None:
        self.count, self.total, self.most, self.last = 0, 0.0, 0.0, 0.0
        for s in seconds:
            self.add(s)

    def add(self, seconds: float) -> None:
        self.most = seconds if self.count == 0 else max(self.most, seconds)
        self.count += 1
        self.total += seconds
        self.last = seconds

    def as_dict(self) -> dict[str, float]:
        """The report's ``step_seconds`` ({} before the first step)."""
        return {"mean": self.total / self.count, "max": self.most, "last": self.last} if self.count else {}


def build(*, rank: int, world_size: Optional[int], mode: str, reason: str, policy: Optional[str], device: Optional[int],
          iterations: int, step_times: StepTimes | Iterable[float], recorder_summary: dict[str, Any],
          stats: Optional[dict[str, Any]], last_iteration: Optional[int] = None,
          skipped_iterations: int = 0, final: bool = True) -> dict[str, Any]:
    """Assemble one rank's report (``last_iteration``: the training loop's own number of the
    latest iteration, e.g. Megatron's, which a resumed run continues; ``final``: made as the
    process exits, not during training)."""
    steps = step_times if isinstance(step_times, StepTimes) else StepTimes(step_times)
    return {
        "version": VERSION, "rank": rank, "world_size": world_size, "host": socket.gethostname(), "pid": os.getpid(),
        "mode": mode, "reason": reason, "policy": policy, "device": device, "iterations": iterations,
        "last_iteration": last_iteration, "skipped_iterations": skipped_iterations,
        "step_seconds": steps.as_dict(),
        "phase_seconds": recorder_summary.get("seconds", {}), "marks": recorder_summary.get("marks", 0),
        "host_peak_rss_bytes": host_peak_rss(), "final": bool(final),
        "memory": memory_of(stats) if stats is not None else None,
    }
