"""Replay speed of the C hot path, side by side with other builds; write docs/replay_speed.md.

    python benchmarks/replay_speed.py [--builds CHECKOUT,...] [--trace FILE] [--rounds 9] [--repeats 7]
                                      [--policies npu_pool,torch] [--instructions] [--out docs/replay_speed.md]

One trace (by default the training trace of ../shared/traces with the most events; without the
shared traces, a GPT capture) is replayed by np_replay, in C, through a fresh pool per replay,
by this tree and by each other built checkout given (e.g. the commits before and after a
change). Builds run in turns (each in its own process, the order reversed every other round);
a round's figure is the median of --repeats replays, the table gives the median over rounds of
ops per second and of each build's ratio to the first build's figure of the same round, with the
rounds' range. Wall-clock figures on a shared machine are noisy; --instructions adds the
deterministic measure: instructions executed inside np_replay per op (valgrind's callgrind, one
replay per build and policy).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Runs in a child with one build first on sys.path: replays the saved trace `repeats` times
# through a fresh pool of `policy`, prints [ops, [Mops/s, ...]]. Only Trace.load and
# replay.run, which every build since the C replay loop has.
_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
from npu_pool.trace.format import Trace
from npu_pool.replay import run
t = Trace.load(sys.argv[2])
rates = []
for _ in range(int(sys.argv[4])):
    r = run(t, sys.argv[3])
    assert r.ok, "the replay failed"
    rates.append(r.ops / (r.ns / 1e9) / 1e6)
print(json.dumps([r.ops, rates]))
"""


def _label(checkout: Path) -> str:
    """The checkout's commit (with '+' when its tree differs from it), else its folder's name."""
    try:
        rev = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(checkout), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return rev + ("+" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return checkout.name


def _child(checkout: Path, trace: Path, policy: str, repeats: int, wrap: list[str] | None = None) -> list:
    cmd = [*(wrap or []), sys.executable, "-c", _CHILD, str(checkout), str(trace), policy, str(repeats)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"replay_speed: {checkout} ({policy}) failed: {p.stderr.strip().splitlines()[-1:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _by_function(out: Path) -> dict[str, int]:
    """Self instructions per function of a callgrind file (recursion levels merged), or {} without
    callgrind_annotate."""
    tool = shutil.which("callgrind_annotate")
    if not tool:
        return {}
    text = subprocess.run([tool, "--threshold=100", str(out)], capture_output=True, text=True).stdout
    got: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r"\s*([\d,]+) \([ \d.]+%\)\s+\S*?:(\S+)", line)
        if m and "PROGRAM TOTALS" not in line:
            fn = m.group(2).split("'")[0]
            got[fn] = got.get(fn, 0) + int(m.group(1).replace(",", ""))
    return got


def instructions_per_op(checkout: Path, trace: Path, policy: str, tmp: Path) -> tuple[float, dict] | None:
    """Instructions executed inside np_replay per op (callgrind), and per function, or None without valgrind."""
    valgrind = shutil.which("valgrind")
    if not valgrind:
        return None
    out = tmp / f"callgrind.{os.getpid()}.out"
    ops, _ = _child(checkout, trace, policy, 1, [valgrind, "--tool=callgrind", "--toggle-collect=np_replay",
                                                 f"--callgrind-out-file={out}"])
    total = None
    for line in out.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            total = int(line.split()[1])
    funcs = {k: v / ops for k, v in _by_function(out).items()}
    out.unlink()
    return (total / ops, funcs) if total is not None else None


def pick_trace(shared: Path, given: str | None, tmp: Path) -> tuple[str, Path]:
    """(name, .npt path): the given file, or the shared training trace with the most events, or a GPT capture."""
    from npu_pool.trace.files import open_traces

    if given:
        named = open_traces(given)
    elif shared.is_dir():
        named = [nt for p in sorted(shared.glob("*.pickle")) for nt in open_traces(p) if "train" in nt[0]]
    else:
        named = []
    if not named:
        from npu_pool.capture import capture

        named = [("cpu-gpt-train", capture(model_name="gpt", steps=4, progress=False))]
    name, trace = max(named, key=lambda nt: len(nt[1]))
    path = tmp / "trace.npt"
    trace.save(path)  # the format every build reads
    return name, path


def measure(builds: list[Path], trace: Path, policies: list[str], rounds: int, repeats: int) -> dict:
    """{(build, policy): {"rate": [round medians], "ratio": [ratio to builds[0] per round]}}, ops."""
    got: dict = {(b, p): {"rate": [], "ratio": []} for b in builds for p in policies}
    ops = 0
    for r in range(rounds):
        this_round: dict = {}
        for b in builds if r % 2 == 0 else builds[::-1]:
            for p in policies:
                ops, rates = _child(b, trace, p, repeats)
                this_round[b, p] = statistics.median(rates)
        for (b, p), v in this_round.items():
            got[b, p]["rate"].append(v)
            got[b, p]["ratio"].append(v / this_round[builds[0], p])
    return {"rows": got, "ops": ops}


def render(name: str, ops: int, builds: list[Path], labels: dict, policies: list[str], got: dict, instr: dict,
           args: argparse.Namespace, seconds: float) -> str:
    cmd = "python benchmarks/replay_speed.py" + "".join(
        f" {k} {v}" for k, v in [("--builds", args.builds), ("--trace", args.trace), ("--policies", args.policies if args.policies != "npu_pool,torch" else ""),
                                 ("--rounds", args.rounds), ("--repeats", args.repeats)] if v)
    cmd += " --instructions" if args.instructions else ""
    lines = [
        "# Replay speed: the hot path, side by side",
        "",
        f"Written by `{cmd}` ({time.strftime('%Y-%m-%d')}, {os.uname().machine}, {os.cpu_count()} cores, "
        f"{seconds:.0f} s). Trace: {name} ({ops} malloc and free ops), replayed by `np_replay` (C) through "
        f"a fresh simulated device per replay with room to spare. Builds ran in turns, {args.rounds} rounds "
        f"of {args.repeats} replays each (the order reversed every other round); figures are medians over "
        "rounds, with the range of the round medians. `this tree` is the checkout running the script; the "
        "others are built checkouts of the commits named (`git worktree add DIR COMMIT && cd DIR && "
        "python setup.py -q build_ext --inplace`).",
        "",
        "Instructions per op are exact and repeatable (valgrind's callgrind, counting only inside "
        "`np_replay`); M ops/s are wall-clock on a shared machine and move with its load: compare "
        "builds within this table only.",
        "",
    ]
    head = "| build |" + "".join(f" {p} M ops/s | {p} vs {labels[builds[0]]} |" for p in policies)
    rule = "|---|" + "---:|---:|" * len(policies)
    if instr:
        head += "".join(f" {p} instructions/op |" for p in policies)
        rule += "---:|" * len(policies)
    lines += [head, rule]
    for b in builds:
        row = f"| {labels[b]} |"
        for p in policies:
            g = got[b, p]
            row += (f" {statistics.median(g['rate']):.2f} ({min(g['rate']):.2f}-{max(g['rate']):.2f}) |"
                    f" {statistics.median(g['ratio']):.2f} |")
        for p in policies if instr else []:
            v = instr.get((b, p))
            row += f" {v[0]:.0f} |" if v is not None else " - |"
        lines.append(row)
    lines += ["", *functions_table(builds, labels, policies[0], instr), NOTES]
    return "\n".join(lines) + "\n"


def functions_table(builds: list[Path], labels: dict, policy: str, instr: dict, top: int = 16) -> list[str]:
    """Where the instructions go: self instructions per op of the functions whose share differs most
    between builds (a function renamed or split between builds shows as one row each)."""
    funcs = {b: instr[b, policy][1] for b in builds if instr.get((b, policy)) and instr[b, policy][1]}
    if len(funcs) < 1:
        return []
    names = set().union(*funcs.values())
    spread = {n: max(f.get(n, 0.0) for f in funcs.values()) - min(f.get(n, 0.0) for f in funcs.values()) for n in names}
    if len(funcs) == 1:
        spread = {n: max(f.get(n, 0.0) for f in funcs.values()) for n in names}
    shown = sorted(names, key=lambda n: -spread[n])[:top]
    lines = [f"### Where the instructions go ({policy}, self instructions per op)", "",
             "The functions whose figure differs most between the builds (callgrind_annotate on the same runs; "
             "inlined helpers count in their caller).", "",
             "| function |" + "".join(f" {labels[b]} |" for b in funcs), "|---|" + "---:|" * len(funcs)]
    for n in shown:
        lines.append(f"| `{n}` |" + "".join(f" {funcs[b].get(n, 0.0):.1f} |" for b in funcs))
    return lines + [""]


NOTES = """## What the hot path costs, and what was fixed (issue 19, point 6)

The one-arena redesign (009ef62) made a replay of a training trace slower than the build before
it (fe97307) with every placement the same: the rows of 009ef62 and 84ba63c (main before the fix)
against fe97307's, when the script is given those builds. Per op, the extra instructions went to:

- statistics: `account()` updated the eight block counters through loops over on-stack tables of
  pointers, which the compiler did not unroll (the `account` rows; the allocated/freed sums that
  PyTorch's statistics need are a small part of it once written out);
- the event history: every malloc and free wrote its entry in two passes (zero the entry, then
  its fields), found its slot with a 64-bit division (`n_events % hist_slots`) and regrew the
  default ring by copying it (`np_ctx_record`, `next_entry`, `__memcpy_*`);
- the page-table walk of `np_vmm_unmapped` on every malloc, to learn that a block carved from a
  hole needs nothing mapped;
- the layers the redesign put between the policy and the placement (`np_tags_malloc`,
  `np_tags_budget`, `np_arena_malloc`).

Fixed: `account()` written out; history entries written in one store, the ring's slot kept as a
counter (no division), the default ring allocated once and its growth out of line; a block that
ends below the arena's high-water mark while every page under the mark is mapped (the segment's
mapped bytes equal the mark's) needs no walk (O(1)); a request when no tag exists is a tail call
into the main arena. The treap's insert and remove, the same in every build, were recursive; they
are iterative now (`np_tree_insert`, `np_tree_remove`), which makes every policy, torch's model
too, faster. Every placement, peak, retry, trim and device call of the shared traces is unchanged
(torch, expandable and npu_pool, with room to spare and at a tight cap).

What remains above fe97307 is what the redesign added on purpose: the history's time, pool and
trim flag per event, PyTorch's accumulated allocated/freed sums, the arena's check for cap
pressure, and growths made as whole chunks through the VMM layer (accounted and recorded, where
fe97307 mapped one page per call): a replay with room to spare grows the arena often, a steady
training iteration not at all.

Since 2026-11-28 a request of the npu_pool policy goes back to its place key's last place from
the first optimizer step on (docs/policies.md): per request a hash of its key, a lookup (or an
insert) in the table of places, a pointer-map lookup of the anchor, a check that the place's
carve maps nothing and the new place written back (`np_lifetime_place`, `entry`,
`np_ptrmap_find`, `placed_again` and `carve_mapped` in `try_place`), where best fit's
tree searches go when the place is there (`np_tree_lower_bound`, `np_tree_best_fit`). Against the
build before it (b8ddbdc), in the same runs: on this trace, whose one optimizer step comes late
and meets new keys only, 819 -> 874 instructions per op; on the H100 recording (ten steps,
`--trace benchmarks/traces/h100-gpt-bf16-train.pickle`) 867 -> 912, 1.01x the ops per second;
on a CPU capture of 200 steps with layer markers (`capture(model_name="gpt", steps=200, dim=128,
seq=128, batch=4)` saved as a trace, `--trace` it) 799 -> 851, 0.94x: about 50 instructions
per op where places are kept, about 11 (the context's bookkeeping) for the torch model, which
keeps none. Kept at that price: on a full device it took the H100 recording's steady iterations
from 551 device calls to 5 (docs/device_calls.md), each a stall of microseconds where an op costs
about 0.1.

The torch model's replay is slower than fe97307's since 2026-11-26 (beebde2): the simulated
device now places each segment's cudaMalloc where the CUDA driver does (`cuda_addr`, inlined in
`take_addr`: 32 MiB granules taken top down, a segment under a granule at the lowest free range
of a granule in use), which made the torch model equal the real caching allocator on every live
row (docs/gpu.md). It scans the device's ranges per segment malloc, where fe97307 bumped a
pointer: 267 instructions per op on this trace against 3.9 in fe97307 (`--policies
torch,npu_pool --instructions` lists them). The npu_pool policy makes no such malloc.
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--builds", default="", help="other built checkouts, comma-separated (the first is the reference)")
    ap.add_argument("--trace", help="a trace or snapshot file (default: the largest shared training trace)")
    ap.add_argument("--shared", default=str(ROOT.parent / "shared" / "traces"))
    ap.add_argument("--policies", default="npu_pool,torch")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--instructions", action="store_true", help="also count instructions per op (needs valgrind)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "replay_speed.md"))
    args = ap.parse_args()
    if args.rounds < 1 or args.repeats < 1:
        ap.error("--rounds and --repeats must be at least 1")
    builds = [Path(b).resolve() for b in args.builds.split(",") if b] + [ROOT]
    for b in builds:
        if not list((b / "npu_pool").glob("_core*.so")):
            ap.error(f"{b} is not a built checkout (no npu_pool/_core*.so; run python setup.py -q build_ext --inplace there)")
    policies = [p for p in args.policies.split(",") if p]
    labels = {b: "this tree" if b == ROOT else _label(b) for b in builds}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        from npu_pool.trace.format import TraceError

        try:
            name, trace = pick_trace(Path(args.shared), args.trace, Path(tmp))
        except TraceError as e:
            ap.error(str(e))
        res = measure(builds, trace, policies, args.rounds, args.repeats)
        instr = {}
        if args.instructions:
            for b in builds:
                for p in policies:
                    instr[b, p] = instructions_per_op(b, trace, p, Path(tmp))
    text = render(name, res["ops"], builds, labels, policies, res["rows"], instr, args, time.time() - t0)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
