"""Device calls of each policy on real and captured traces; write docs/device_calls.md.

    python benchmarks/device_calls.py [--shared ../shared/traces] [--out docs/device_calls.md]
                                      [--costs FILE] [--baseline CHECKOUT [--baseline-name TEXT]]...
                                      [--no-capture]

Per trace and policy (torch, expandable, npu_pool, npu_pool with compaction, planned): the device calls by kind given room
to spare, at the minimum capacity and on the device the torch model just fits (its minimum
capacity: a full device, as training runs), the estimated device time (npu_pool/device_costs.py), the
physical allocations (segments or chunks) against the torch model's, the calls in iterations
after the first, and the minimum-capacity waste; #19's bounds, under each trace's own rules and
again under torch_npu's (torch, npu_pool and npu_pool with compaction). With --baseline (a built checkout of another
version, e.g. the commit before the chunked VMM layer; repeatable), its minimum-capacity waste and
physical calls there on the same traces are measured too, in a subprocess, for the before/after
table.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from fragmentation import collect, snapshots  # noqa: E402  (the same traces as docs/benchmarks.md)
from npu_pool.device_costs import estimate_us, load_costs, physical_calls  # noqa: E402
from npu_pool.replay import evaluate, iteration_bounds, run, steady_calls, steady_stretches  # noqa: E402

POLICIES = ["torch", "expandable", "npu_pool", "planned"]  # (the baselines' too)
# The page's columns: a policy, and the pool's options (compacting: npu_pool with compaction, docs/api.md)
COLUMNS = {"torch": ("torch", {}), "expandable": ("expandable", {}), "npu_pool": ("npu_pool", {}),
           "compacting": ("npu_pool", {"compact": True}), "planned": ("planned", {})}
COPY_GBPS = 20.0  # host copies, each way: an assumption (PCIe 4.0 x16 moves about 25 GB/s at best), as the call costs
MEASURED = ROOT / "benchmarks" / "results" / "h100-2026-11-25" / "costs.json"  # a GPU's measured costs
MiB = float(1 << 20)

_BASELINE = """
import json, sys
sys.path[:0] = [{root!r}, {root!r} + "/benchmarks", {here!r}]
from pathlib import Path
from fragmentation import collect
from npu_pool.replay import evaluate
from npu_pool.planner import make_plan
from npu_pool.trace.files import open_traces
named = [nt for p in {snapshots!r} for nt in open_traces(p)] + collect(Path("/nonexistent"), {capture!r})
out = {{}}
for name, trace in named:
    plan = make_plan(trace)
    for policy in {policies!r}:
        r = evaluate(trace, name, policy, **({{"plan": plan}} if policy == "planned" else {{}}))
        c = getattr(r, "calls_at_min_capacity", None)  # older checkouts may not count calls
        phys = sum(c.get(k, 0) for k in ("malloc", "free", "phys_create", "phys_release")) if c else None
        out[name + "|" + policy] = [r.min_capacity_bytes - r.peak_live_bytes, phys]
print(json.dumps(out))
"""


def baseline_waste(checkout: Path, shared: Path, capture: bool) -> dict[str, list]:
    """Minimum-capacity waste and physical calls there (None where that checkout does not count
    calls) per "trace|policy", measured by another checkout's own code."""
    code = _BASELINE.format(root=str(checkout), here=str(ROOT / "benchmarks"), capture=capture, policies=POLICIES,
                            snapshots=[str(p) for p in snapshots(shared)])  # (the same snapshots as this run's)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(checkout))
    if r.returncode:
        raise SystemExit(f"baseline {checkout}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else 'failed'}")
    return json.loads(r.stdout.strip().splitlines()[-1])


@dataclass
class Measured:
    """Every trace under each column's policy, under one device's request rules."""

    rows: list = field(default_factory=list)  # (name, column, PolicyResult: its steady_calls given room to spare)
    torch_of: dict = field(default_factory=dict)  # name -> the torch model's PolicyResult (each trace's device is its min capacity)
    full: dict = field(default_factory=dict)  # (name, column) -> calls on the device the torch model just fits (None: fails)
    full_steady: dict = field(default_factory=dict)  # ... in its iterations after the first, steady ones
    moved: dict = field(default_factory=dict)  # compacting: stats at the minimum capacity, on the full device


def measure(named: list, columns: dict, device: str | None = None) -> Measured:
    """Each trace under each column (the torch model's first), given room, at its minimum capacity
    and on the device the torch model just fits; ``device``: whose request rules (default each
    trace's own)."""
    from npu_pool.planner import make_plan

    m = Measured()
    for name, trace in named:
        plan = make_plan(trace) if any(policy == "planned" for policy, _ in columns.values()) else None
        bounds = iteration_bounds(trace)
        for column, (policy, options) in columns.items():
            kw = {"plan": plan, **options} if policy == "planned" else dict(options)
            m.rows.append((name, column, evaluate(trace, name, policy, bounds=bounds, device=device, **kw)))
            if policy == "torch":
                m.torch_of[name] = m.rows[-1][2]
            at = run(trace, policy, m.torch_of[name].min_capacity_bytes, bounds=bounds or None, device=device, **kw)
            m.full[name, column] = at.calls if at.ok else None
            m.full_steady[name, column] = (sum(sum(d.values()) for d in at.iteration_calls[2:]),
                                           steady_calls(at.iteration_calls, at.iteration_peaks)) if at.ok and bounds else None
            if options.get("compact"):
                m.moved[name] = (m.rows[-1][2].stats_at_min_capacity, at.stats if at.ok else None)
    return m


def bound_lines(m: Measured, named: list) -> list[str]:
    """Whether #19's bounds hold, trace by trace, for npu_pool and npu_pool with compaction."""
    out = []
    repeat = [name for name, _ in named if any(v is not None for (n, _), v in m.full_steady.items() if n == name)]
    for column, who in (("npu_pool", "npu_pool"), ("compacting", "npu_pool with compaction")):
        out.append(f"{who}:")
        for at_min in (False, True):
            ok = bad = 0
            for name, policy, r in m.rows:
                if policy != column:
                    continue
                t = m.torch_of[name]
                a, b = (r.calls_at_min_capacity, t.calls_at_min_capacity) if at_min else (r.calls, t.calls)
                ok += physical_calls(a) <= physical_calls(b)
                bad += physical_calls(a) > physical_calls(b)
            where = "at the minimum capacity" if at_min else "given room to spare"
            out.append(f"- chunks created + released <= the torch model's mallocs + frees {where}: "
                       f"{ok} of {ok + bad} traces")
        ok = sum(1 for name, _ in named if m.full[name, column] and m.full[name, "torch"] and
                 physical_calls(m.full[name, column]) <= physical_calls(m.full[name, "torch"]))
        out.append(f"- the same on the device the torch model just fits: {ok} of {len(named)} traces")
        rep = [r for _, policy, r in m.rows if policy == column and r.steady_calls is not None]
        at_full = [m.full_steady[name, column][1] for name in repeat
                   if m.full_steady[name, column] and m.full_steady[name, column][1] is not None]
        out += [f"- no device call in steady iterations given room to spare: "
                f"{sum(r.steady_calls == 0 for r in rep)} of the {len(rep)} traces with steady iterations; "
                f"on the device the torch model just fits: {sum(c == 0 for c in at_full)} of {len(at_full)}", ""]
    return out


def _kinds(c: dict[str, int]) -> str:
    return ", ".join(f"{k} {n}" for k, n in c.items() if n) or "none"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", default=str(ROOT.parent / "shared" / "traces"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "device_calls.md"))
    ap.add_argument("--costs", metavar="FILE", help="JSON {call kind: microseconds} over the default costs")
    ap.add_argument("--baseline", metavar="CHECKOUT", action="append", default=[],
                    help="a built checkout whose min-capacity waste and calls to compare (repeatable)")
    ap.add_argument("--baseline-name", metavar="TEXT", action="append", default=[],
                    help="what the baseline of the same position is, for the page (default: its path)")
    ap.add_argument("--no-capture", action="store_true")
    args = ap.parse_args(argv)
    costs = load_costs(args.costs)
    t0 = time.time()
    named = collect(Path(args.shared), not args.no_capture)
    own = measure(named, COLUMNS)
    rows, torch_of, full, full_steady, moved = own.rows, own.torch_of, own.full, own.full_steady, own.moved
    on_npu = measure(named, {k: COLUMNS[k] for k in ("torch", "npu_pool", "compacting")}, "npu")
    if len(args.baseline_name) > len(args.baseline):
        ap.error("--baseline-name names a --baseline: give as many baselines")
    names = args.baseline_name + args.baseline[len(args.baseline_name):]
    before = [(n, c, baseline_waste(Path(c), Path(args.shared), not args.no_capture)) for n, c in zip(names, args.baseline)]

    cmd = "python benchmarks/device_calls.py" + "".join(f" --baseline {shlex.quote(b)}" for b in args.baseline) + \
        "".join(f" --baseline-name {shlex.quote(n)}" for n in args.baseline_name) + \
        (f" --costs {shlex.quote(args.costs)}" if args.costs else "")
    out = ["# Device calls: what each policy asks of the device", "",
           f"Written by `{cmd}` ({len(named)} traces, {time.time() - t0:.0f} s). Every figure is a count",
           "of calls the simulated device received, which counts what the ACL backend would call for the",
           "same requests (tests/test_device_calls.py checks it against the fake CANN's own counters);",
           "the torch model's, what torch_npu's own allocator calls (tests/test_live_replay.py: live, kind",
           "by kind): no device lookup, and on a device the cap is the whole of, a malloc past its memory",
           "asked of the device and refused (a call, counted) before it frees its cache and asks again.",
           "`npu-pool replay TRACE` prints these groups for any trace, the steady calls among them",
           "(`--json`: `calls`, `calls_at_min_capacity`, and per iteration `iteration_calls` and",
           "`iteration_peak_live`).", "",
           "## Per trace", "",
           "physical: segments (malloc + free) or chunks (phys_create + phys_release) taken and given back;",
           "est ms: the estimated device time of all calls (cost table below); steady: calls in the steady",
           "iterations, every one after the first that needs no more live memory than an earlier stretch did",
           "(the set-up included; iteration bounds: iteration markers, else the optimizer's, else the",
           "planner's loop body, the last iteration up to the trace's last iteration-end marker; - when",
           "none repeat or none is steady);",
           "waste: minimum capacity - peak live; compacting: npu_pool with compaction (off by default:",
           "docs/api.md, Compaction; its copies are in the section Compaction).", "",
           "| trace | policy | physical | map+unmap | est ms | steady | @min cap: physical | map+unmap | est ms | waste (MiB) |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, policy, r in rows:
        steady = r.steady_calls
        c, m = r.calls, r.calls_at_min_capacity
        out.append(f"| {name} | {policy} | {physical_calls(c)} | {c['map'] + c['unmap']} | {estimate_us(c, costs) / 1e3:.1f} | "
                   f"{'-' if steady is None else steady} | {physical_calls(m)} | {m['map'] + m['unmap']} | "
                   f"{estimate_us(m, costs) / 1e3:.1f} | {(r.min_capacity_bytes - r.peak_live_bytes) / MiB:.0f} |")
    room_peak = {name: r.peak_reserved_bytes for name, policy, r in rows if policy == "npu_pool"}
    fits = sum(room_peak[name] <= torch_of[name].min_capacity_bytes for name, _ in named)
    out += ["", "## On a full device", "",
            "Each trace replayed on the device the torch model just fits (its minimum capacity), as a training",
            "run fills its card: physical calls (est ms of all calls). Every other policy needs less memory",
            "than the torch model, so it has room to spare there, but not the 1 TiB of the first table.",
            "npu_pool given room: the most npu_pool holds at once given room to spare (the first table's",
            f"run); it is no more than the device on {fits} of {len(named)} traces, so there npu_pool's calls",
            "on this device come from its rules under cap pressure, which start at half of the cap whatever",
            "room is left (Known limits), not from memory it lacks.", "",
            "| trace | device (GiB) | npu_pool given room (GiB) | " + " | ".join(COLUMNS) + " |",
            "|---|---:|---:|" + "---:|" * len(COLUMNS)]
    for name, _ in named:
        device = torch_of[name].min_capacity_bytes
        cells = [f"{physical_calls(full[name, p])} ({estimate_us(full[name, p], costs) / 1e3:.0f})" if full[name, p]
                 else "fails" for p in COLUMNS]
        out.append(f"| {name} | {device / (1 << 30):.3f} | {room_peak[name] / (1 << 30):.3f} | " + " | ".join(cells) + " |")
    repeat = [name for name, _ in named if any(full_steady[name, p] is not None for p in COLUMNS)]
    out += ["", "Steady iterations there: the calls of every kind in the iterations after the first, then in the",
            "steady ones among them (as the steady column of the first table), on the traces whose iterations",
            "repeat; first steady: the first steady iteration (1 is the first iteration; - none).", "",
            "| trace | first steady | " + " | ".join(COLUMNS) + " |", "|---|---:|" + "---:|" * len(COLUMNS)]
    for name in repeat:
        marks = steady_stretches(torch_of[name].iteration_peak_live or [])
        first = next((k for k, s in enumerate(marks) if s), None)
        out.append(f"| {name} | {'-' if first is None else first} | " +
                   " | ".join("fails" if full_steady[name, p] is None else
                              "%d / %s" % (full_steady[name, p][0], "-" if full_steady[name, p][1] is None
                                           else full_steady[name, p][1]) for p in COLUMNS) + " |")
    out += ["", "## Calls by kind (room to spare)", ""]
    for name, policy, r in rows:
        out.append(f"- {name}, {policy}: {_kinds(r.calls)}")
    out += ["", "## Bounds", ""] + bound_lines(own, named)
    out += ["Under torch_npu's request rules (`--device npu`: every request padded to round_up(r, 32) + 32",
            "bytes, the torch model as torch_npu's allocator), each policy measured again the same way:", ""]
    out += bound_lines(on_npu, named)
    out += ["## Compaction", "",
            "The compacting column's copies (docs/api.md, Compaction): chunks replaced and the live bytes moved",
            "through host memory, at its minimum capacity and on the device the torch model just fits; est ms:",
            f"the copies' time at {COPY_GBPS:g} GB/s each way (an assumption, as the call costs), which the",
            "est ms of the tables above leave out.", "",
            "| trace | @min cap: compactions | MiB moved | est ms | full device: compactions | MiB moved | est ms |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for name, _ in named:
        cells = []
        for st in moved[name]:
            cells += ["fails"] * 3 if st is None else \
                [str(st["compactions"]), f"{st['compacted'] / MiB:.0f}", f"{2 * st['compacted'] / COPY_GBPS / 1e6:.1f}"]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    out += ["", "## Minimum-capacity waste (MiB)", ""]
    tot = {p: sum(r.min_capacity_bytes - r.peak_live_bytes for _, q, r in rows if q == p) for p in COLUMNS}
    calls = {p: sum(physical_calls(r.calls_at_min_capacity) for _, q, r in rows if q == p) for p in COLUMNS}
    if before:
        out += ["Each version measured by its own code on the same traces (baselines: built checkouts, " +
                ", ".join(f"`{c}`" for _, c, _ in before) + ", each made by `git worktree add DIR COMMIT && cd DIR && "
                "python setup.py -q build_ext --inplace`); physical: the calls at the minimum capacity,",
                "summed over the traces (- where a version does not count them); / first: the waste over the",
                "first version's (compacting: over npu_pool's first version's, the waste #19 bounds).", "",
                "| policy | version | waste | / first | physical |", "|---|---|---:|---:|---:|"]
        for p in COLUMNS:
            base = COLUMNS[p][0]  # (compacting: npu_pool's versions)
            versions = [(n, sum(v[0] for k, v in d.items() if k.endswith("|" + base)),
                         [v[1] for k, v in d.items() if k.endswith("|" + base)]) for n, _, d in before]
            first = versions[0][1]
            if p not in POLICIES:  # (no baseline compacts: its row is this checkout's only)
                versions = []
            versions.append(("this checkout", tot[p], [calls[p]]))
            for n, w, cs in versions:
                phys = sum(cs) if cs and None not in cs else "-"
                out.append(f"| {p} | {n} | {w / MiB:.1f} | {w / first:.2f} | {phys} |" if first else
                           f"| {p} | {n} | {w / MiB:.1f} | - | {phys} |")
    else:
        out += ["| policy | waste | physical calls |", "|---|---:|---:|"] + \
            [f"| {p} | {tot[p] / MiB:.1f} | {calls[p]} |" for p in COLUMNS]
    out += ["", "## Per-call costs (microseconds) and their sources", ""]
    if MEASURED.is_file():
        m = {k: us for k, (us, _) in load_costs(str(MEASURED)).items()}
        out += [f"Measured on an H100 (docs/gpu.md) the CUDA memory calls cost less than these defaults (20 MiB:",
                f"cuMemCreate {m['phys_create']:g} us, a map {m['map']:g} us, cudaMalloc {m['malloc']:g} us):",
                f"`--costs {MEASURED.relative_to(ROOT)}` estimates with those. The defaults stay for an",
                "Ascend card, which nobody here has measured.", ""]
    out += ["| call | us | source |", "|---|---:|---|"]
    for k, (us, src) in costs.items():
        out.append(f"| {k} | {us:g} | {src} |")
    Path(args.out).write_text("\n".join(out) + "\n" + NOTES)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


NOTES = """
## How the pool takes physical memory (docs/engine.md has the code map)

- A chunk is one `aclrtMallocPhysical` and one `aclrtMapMem` (CUDA: `cuMemCreate`, `cuMemMap`,
  `cuMemSetAccess`). Far from the cap a growth of the npu_pool arena is one chunk of at least
  20 MiB (PyTorch's large-pool segment); while the arena has no free memory below its top (a
  set-up that only places), of at least an eighth of what it holds, so that it grows
  geometrically, in few chunks. It stops while a freed hole is in the arena: a large chunk
  holding freed holes cannot be trimmed, and growing geometrically regardless held 80-320 MiB
  more at the peak over five fake 7B-13B captures (1.03-1.4x their peak live). A growth the
  device refuses whole (it has less free than that: other processes hold the rest) maps the
  block's own pages instead, before the request fails. Past half of the
  cap growths are exact, in chunks that free up whole with their block: the pages a block covers
  whole are one chunk, and a page it shares with a neighbour (its first or last, when it starts
  or ends inside one) one of its own, so that a trim under cap pressure can return a freed
  block's memory whatever its neighbours hold. A request of whole pages that grows the arena's top there starts on a page boundary, so
  that it shares no page: its growth is one chunk, and the piece of the page below it skips is a
  hole for smaller requests. Under torch_npu's request rules no request is whole pages (each is
  padded by 32 bytes and rounded to 512), so this applies under CUDA's. A chunk is unmapped
  whole, only when it is entirely free (the vendors unmap whole mappings only; the simulated
  device refuses anything else).
- Under cap pressure a block that must go inside a wholly free chunk (no other hole or end of a
  hole avoids it) unmaps that chunk first, as a trim, and maps only its own pages, instead of
  pinning the whole chunk while it lives.
- A trim keeps the physical allocations of the chunks it unmaps (spares, counted as reserved:
  the device holds them for the pool), and a growth maps a spare again where it fits (whole,
  over an unmapped run at least its size), in the same call or a later one: a chunk moved so
  costs an unmap and a map instead of an unmap, a release, a creation and a map. Before a
  growth no spare fits creates a chunk, spares go back, largest first, only until the chunk fits
  under the cap with those that stay and they hold 20 MiB at most (a growth granule; keeping all
  the cap allows would hold reserved memory nothing maps, up to the cap, on any trace past half
  of it). A device that refuses the chunk even so (another process holds memory under the cap)
  gets every spare back and is asked again; empty_cache, the retry after an out-of-memory, a new
  cap and close give every spare back.
- The expandable model maps one handle per page of 2 MiB (small pool) or 20 MiB (large pool), as
  PyTorch's `ExpandableSegment::map` does.
- The planned policy's region is one device allocation. Its fallback arena grows exactly (no
  granule) while a plan is installed, and maps what the plan says lives outside it when the
  region is reserved, short of cap pressure (the plan's `outside_peak_bytes`; before 2026-11-26
  it mapped at the first request the plan left out, in the second iteration of cnn-adam-train
  and the second and third of cs336-medium-ctx1024-infer, whose unplanned 16 MiB tensor lives
  into the next pass, two at once, which the plan's figure did not count). Since 2026-11-27 a
  plan of a whole trace is checked on the recorded step made twice more as well (docs/planner.md,
  "Never worse than the online pool"), and four of the six whole-trace plans here run online: the
  planned rows of those traces are the npu_pool policy's, and the planned policy's
  minimum-capacity waste below rose with them (those plans held in the recorded step only).
- From the first optimizer step on (phase markers: the layout that repeats holds the optimizer's
  states), a request goes back to the place the last block of its place key had (its site in its
  layer and micro-batch, `context.c`, `place_key`), when that block lay against an allocated
  block that is still there and the free block beside it fits, starting where that block did
  (above the neighbour) or ending at the neighbour (below it) (`arena.c`, `placed_again`; before
  2026-11-28 best fit alone): a loop that repeats then repeats its layout, which fitted in what is
  mapped. Far from the cap a place that would map memory (after `empty_cache`) yields to a hole
  best fit carves without mapping, and a request a place would fail goes by best fit. Best fit alone chose
  otherwise where lifetime classes settle late: the H100 recording's only markers are the
  optimizer's, so its second iteration's requests are all of sites first seen, 753 of them
  change class in the third, and four 128 MiB blocks went elsewhere there, the last one past the
  mapped top (a 24 MiB chunk: a creation, a map and CUDA's set_access). With places it maps
  nothing after its second iteration, given room to spare or on the device the torch model just
  fits with compaction (tests/test_device_calls.py), and on that device without compaction it
  makes 5 calls in its steady iterations where it made 551. Over the 13 traces here places took
  npu_pool's minimum-capacity waste from 113.1 to 111.1 MiB and its physical calls at the
  minimum capacity from 8107 to 8022 (the waste table's rows of this checkout, before and after;
  compacting: 143.1 MiB either way, 2622 calls to 2464; under torch_npu's rules, compacting,
  `RULES=npu python benchmarks/results/sim-2026-11-28/frontier.py`: 427.1 to 423.1 MiB, 2938 to
  2845 calls).
- The current device is kept per thread (as torch_npu keeps it): chunk calls, stream queries,
  event waits and the copies of a paused tag's backup make no `aclrtGetDevice`; the rarer calls
  that would go to the wrong device if a caller changed it behind the pool's back (malloc, free,
  synchronise, reserve, release, and a pause or resume, once) look it up. A forked child looks it
  up again; `np_forget_device()` forgets it.

## Compaction: the bounds for a pool that may move live bytes (2026-11-28)

- What keeps a chunk mapped is a live block in it: a chunk is mapped and returned whole, so the
  rules below (exact growths past half the cap, carves that avoid pinning a free chunk or unmap
  it first) keep blocks of different lives out of shared chunks, at the price of a chunk per
  growth there and the trims. Compaction (the compacting rows and columns;
  `Pool.set_compaction`, docs/api.md) frees what a live block pins instead, when a request needs
  it: a request that finds no room even after the device was synchronised and every wholly free
  chunk returned has the chunks holding live blocks and free pages replaced by chunks over their
  live pages, the live bytes copied through host memory at the same addresses, the chunks that
  free the most pages per live page first, until the cap has room for the request. None of the
  rules under cap pressure apply with compaction: growths stay coarse up to the cap. The tables
  above show what that does to both bounds and to the waste #19 allows (the section Bounds, the
  waste table's compacting row against npu_pool's first version), and the section Compaction
  what it copies: on the device the torch model just fits, nothing on 11 of the 13 traces (1.2
  GiB over the whole run of cs336-medium-ctx128-train, 0.8 GiB over llama7b-offload-infer's,
  which gives its cache back every iteration); at the minimum capacity up to 3.7 GiB over a run. It is off by default: the bytes move while
  the device is idle, which the pool can make sure of for the work already queued (a
  synchronisation; torch_npu's task queue drained first) but not for work another thread queues
  meanwhile, so it is for programs where one thread at a time drives the device (a training
  loop and its autograd thread), and the pool cannot tell. `Pool.compact()` (docs/api.md) runs
  the same compaction, over every chunk, at a moment the caller chooses and vouches for; not a
  remedy for steady calls: at every iteration boundary of the runs on the device the torch model
  just fits it multiplied them (551 to 8096 over h100-gpt-bf16-train's steady iterations, before
  a request went back to its place; benchmarks/results/sim-2026-11-28b), giving back what the
  next iteration maps again.
- Compaction's first form (commit 18c1168) kept the rules under cap pressure, applying past the
  budget, compacted the chunks with the most free pages first, and until the request's size was
  freed whatever the cap had left: the physical bound at the minimum capacity held on 10 of 13
  traces, no steady call on the full device on 4 of 7, for 145.1 MiB of waste (now 13, 7 and
  143.1), and it moved 5.6 GiB on the full device over the 13 traces (now 2.1).
  benchmarks/results/sim-2026-11-28 has a patch with a switch for each change and the figures
  of each combination: the calls came from the carves' unmaps of free chunks (`unpin`).
- What is still over the bounds with compaction: under each trace's own (CUDA's) rules, nothing
  (until 2026-11-28 h100-gpt-bf16-train's one chunk in its third iteration, given room to spare
  and on the full device: above, places). Under torch_npu's rules (the section Bounds) two traces
  miss the bound at the minimum capacity: cnn-adam-train (19 chunks against 7 segments) and
  h100-gpt-bf16-train (182 against 51). torch_npu's allocator makes no more calls at its minimum
  capacity than given room to spare there (it needs about what it holds given room: 122 MiB for
  cnn-adam-train's 103 MiB live, 2268 for h100-gpt-bf16-train's 2089), where npu_pool at its own
  (106 and 2114 MiB) compacts and trims to fit; on the device torch_npu's allocator just fits it
  makes 6 and 51 calls.

## Known limits (without compaction)

- Past half of the cap growths are exact, so on a full device (the table "On a full device") and
  at the minimum capacity the arena makes more physical calls than the torch model on most
  traces: a chunk per growing block past half the cap, two where the block shares its last page
  with the next one (every block under torch_npu's padded requests; once per run in training,
  after every `empty_cache` in an offloading run), and at the minimum capacity the trims under
  pressure besides (tests/test_device_calls.py marks the bound at the minimum capacity as an
  expected failure).
  That is the price of its small waste, and on Ascend it cannot be had for less: a physical
  allocation is mapped whole, at offset 0 (`aclrtMapMem`: the size of the
  `aclrtMallocPhysical` it maps, offset 0 only, CANN's documentation), so a chunk can be neither
  mapped nor returned in parts, and a chunk that holds one live block keeps all of its memory.
  Chunkier growth near the cap cuts these calls and raises the minimum-capacity waste far past
  the 10% allowed (measured: one chunk per growth, a block's shared pages in its own chunk,
  thresholds of free room instead of half the cap, units of 4 to 20 MiB); no rule tried met both
  bounds. Nor did these (2026-11-26, npu_pool's waste summed over the 13 traces against 111 MiB
  then, bound met at the minimum capacity on 4 of 13 then): mapping a spare larger than the run
  over the free unmapped pages around it instead of creating a chunk (10 of 13, 621 MiB: a large
  spare held by a small block is no longer there for the large request it came from); exact
  growth only past 3/4 or 15/16 of the cap (5 and 8 of 13, 457 and 1747 MiB); chunky growth for
  long-lived blocks only (7 of 13, 365 MiB); unmapping a wholly free chunk before a carve only
  for long-lived blocks or only within 64 MiB of the cap (5 and 7 of 13, 157 and 599 MiB);
  keeping every spare the cap allows (3 of 13, 111 MiB); trims that unmap only the chunks they
  need (3 of 13, 109 MiB). benchmarks/results/sim-2026-11-26 has a patch with switches for the
  rules of this arena and a script that prints these figures for each (waste, physical calls,
  both bounds): every switch meeting the bound at the minimum capacity on 7-8 of 13 traces needs
  350-1750 MiB of waste, and the rule that unmaps a wholly free chunk before a block pins it is
  both what keeps the waste small and a source of the steady calls on a full device. Nor did
  cutting each near-cap chunk into chunks of power-of-two pages, so that spares compose into
  later growths (2026-11-27, benchmarks/results/sim-2026-11-27: 3 or 4 of 13 in every variant,
  up to 2.3 times the calls): at the minimum capacity most calls are creations, which a cut
  multiplies, and the spares left at that cap rarely sum to the next growth.
- On a full device the arena moves chunks in steady iterations where the torch model's cached
  segments make few calls or none (the table "Steady iterations there": 2260 calls over the
  iterations after the first of cs336-medium-ctx1024-infer, all steady, where the torch model
  makes 9 in the second and none after; 551 in the steady iterations of h100-gpt-bf16-train until
  a request went back to its place, 5 since, where the torch model, on the device it just fits,
  frees and mallocs segments every iteration too, 180 calls): with the mapped memory at the cap,
  a request larger than every free mapped range unmaps free chunks to map their memory where it
  goes, and the layout each iteration leaves is not the one the next needs, so it does so again.
  With room to spare it maps new memory instead, and the same two traces made 0 and 6 calls in
  their iterations after the first then, none in their steady ones (CUDA's cuMemSetAccess after
  each map counted since 2026-11-26, ninth session).
  What brings the mapped memory to the cap there is the rules under cap pressure, not the
  memory: given room to spare the arena's layout holds no more than the full device on most
  traces (the table "On a full device" says which: 2.734 GiB on ctx1024-infer's device of 2.924),
  but past half of the cap growths are exact and carves avoid pinning free chunks, a different
  layout that reaches the cap. Those rules are what keeps the minimum-capacity waste small
  (above: starting them later, at 3/4 or 15/16 of the cap, raised it to 457 and 1747 MiB), and
  the pool cannot tell a device it will fill from one it will not. Measured on an H100 (docs/gpu.md, "A full device" and "cudaMalloc's
  granules"): replayed as tensors there, every iteration made the calls the simulator says, kind
  by kind, under both allocators, and they cost time: 0.4-5.2 ms per iteration of ctx1024-infer
  under npu_pool against 0.2-0.3 ms under the CUDA caching allocator. Training the recorded model
  capped at 2162 MiB (the caching allocator's peak there, no byte to spare), npu_pool makes 38
  memory calls in every step from the 14th on (2313 after the second step, the same in every run,
  and in steps 2-10 those of the simulator replaying the recording), where the caching allocator
  makes none. Until 2026-11-26 the
  arena's choices there also depended on timing: under pressure it skipped free memory whose
  stream was still running (a stream query), and how far a GPU runs behind the host differs from
  step to step, so the layout did: about 100 calls a step, and out of memory in 3 of 7 runs at
  2162 MiB. It now waits for the device there (a synchronisation, at most one per request: about
  two a step at 2162 MiB, 44-48 in 60 steps at 2226) and fit 6 of 6 runs. An arena that serves a
  full device from the memory it has mapped (a carve that maps nothing first, chunks split in
  place rather than unmapped) made no call after the fifth step in the simulator, but in real
  training on an H100 and an H200 it still did at the tightest caps (benchmarks/results/
  h200-2026-11-26 and h100-2026-11-26b): not adopted.
- Far from the cap a chunk can hold several blocks (grown by an eighth of the arena, or by a
  granule), and a block that shares a page with its neighbour keeps the neighbour's chunk too:
  under torch_npu's request rules every block does (a request is padded by 32 bytes: a block of
  100 MiB covers 51 pages and the next one starts in its last). Freed among live blocks, such
  memory stays mapped at `empty_cache` until its chunk is wholly free. Freeing every other one of
  ten 100 MiB blocks on a 1 GiB device and calling `empty_cache` leaves npu_pool holding 806 MiB
  for 500 MiB live under torch_npu's rules, and a 300 MiB request then fails, where torch_npu's
  allocator (segments rounded up to 2 MiB) holds 510 and serves it; under CUDA's rules 500 and
  served; half of a 4 GiB device filled with 20-100 MiB blocks, every other one freed, keeps
  530-922 MiB beyond the live bytes under CUDA's rules, where the torch model keeps none, and
  1025-1045 MiB under torch_npu's, where torch_npu's allocator keeps 19-101 (every figure: `python
  benchmarks/results/sim-2026-11-26/freed_large.py`). Tried, on the arena's switches there
  (`NP_BIG`): a chunk of its own pages for every block of 20 MiB or more returns them under CUDA's
  rules at no cost in waste (frontier.py there: 113.1 MiB against 115.1) but not under
  torch_npu's, and doubles the chunks given room to spare on cs336-train-step-b (641 against 339);
  mapping the page such a block shares as a chunk of its own too returns them under both (less a
  page each, as torch_npu keeps) but breaks the bound given room to spare on 4 of the 13 traces
  (cs336-train-step-b: 1205 chunks against the torch model's 995); starting such a block on a page
  boundary raised the minimum-capacity waste to 415 MiB. Not adopted: the first gives nothing on
  Ascend, the others cost what #19 bounds.
- The first two iterations of a training run may grow the arena: the second's peak holds more
  than the first's did, since the optimizer's states, made in the first step's optimizer, are
  live through the second's forward and backward. A pool mapped as tight as npu_pool's grows
  there; the torch model's rounding (20 MiB segments, whole large blocks) leaves it room on some
  traces and not on others. So the steady column leaves out an iteration that needs more live
  memory than every one before it (the second, on the four traces that show it: their
  `iteration_peak_live`; `replay.steady_stretches`). Given room to spare npu_pool then makes no
  call in steady iterations (on h100-gpt-bf16-train's third iteration one chunk until a request
  went back to its place, above; growing by an eighth of what the arena holds far from the cap
  had left it room there too, but held 3.5% more at the peak given room to spare over these
  traces: benchmarks/results/sim-2026-11-26, `NP_HD=8`, not adopted).
- Four threads allocating concurrently make no device call once warm (tests/test_device_calls.py),
  where warm means the pool has held the most the threads can hold at once (each at its own live
  peak together). How threads interleave decides their live peak: after a warm-up of a few rounds
  alone, a later interleaving that holds more than the warm-up did grows any allocator, the torch
  model too (a chunk or a segment at a time). With a stream each: on an H100 (docs/gpu.md,
  2026-11-27) the caching allocator made no call in 47,808 requests after warm-up and npu_pool
  about 21,800 handovers (an event record and a stream wait each) while it merged free memory of
  two streams at any pressure; it merges them only under cap pressure since, and the same
  workload on the simulator with the threads taking turns makes no call (`python
  benchmarks/gpu_probe.py threads npu_pool --simulated`).
  With real threads the interleaving decides which stream's holes are free when: memory still
  changes streams now and then (0-286 handovers in 48,000 requests over 35 runs of the test, a
  rare run one growth): a stream that takes another stream's hole instead of growing shares
  memory the caching allocator would hold twice. Past half the cap (for good once reached: mapped
  memory stays mapped) free memory of two streams merges again, for the memory, and handovers
  come back: on a 2.5 GiB device (`... threads npu_pool --simulated --capacity-mib 2560`) 31,549
  after warm-up and 110 chunks created (32,193 and 34 before the change), where the torch model,
  whose per-stream pools fit, makes none; on 1,800 MiB 22 chunks (58 before), on 3 GiB 904
  handovers (23,340 before).
- The default per-call costs are stated assumptions, not measurements: pass measured ones with
  `--costs`.
"""

if __name__ == "__main__":
    sys.exit(main())
