"""The tables of docs/gpu.md from what ``benchmarks/gpu_session.sh`` measured on a GPU.

    python benchmarks/gpu_report.py RESULTS_DIR [--shared ../shared/traces]

RESULTS_DIR holds a session's files (``live_*.json``, ``gpt_small.json``, ``gpt_large.json``,
``mcore.json``, ``costs.json``, ``repeat_*.json``, ``apis.json`` (``benchmarks/gpu_apis.py``),
``machine.txt``; on a full device
``steady.log`` and ``full_*.json``, the steps ``steady`` and ``full``, or ``ab*_*.json``, runs of
``gpu_check.py --cap-mib`` named by hand; ``threads_*.json``, runs of ``gpu_probe.py threads``;
``compact_*.json``, runs of ``gpu_probe.py compact``):
the GPU's figures are read
from there, and the simulator's are computed now, on this machine, with this checkout (each live
trace beside the simulation of its allocator under CUDA's rules, as ``replay --live --validate``
sets them). Needs no GPU. Prints markdown.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


def _traces(shared: Path) -> dict[str, Any]:
    """The shared traces (where ``shared`` is a folder) and this repository's own (the H100
    recording), by name."""
    from fragmentation import snapshots

    from npu_pool.trace.files import open_traces

    return {name.split(".")[0]: t for p in snapshots(shared) for name, t in open_traces(p)}


_FIGURES = (("peak_reserved_bytes", "peak_reserved_bytes"), ("peak_allocated_bytes", "peak_allocated_bytes"),
            ("min_capacity_bytes", "min_capacity_bytes"), ("device_allocs", "device_mallocs"))


def _changed_since(r: Any, then: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether the live run ``r`` equals, figure by figure, the simulation saved with it (``then``)
    while this checkout's (``now``) differs from that saved one."""
    if then.get("same") is not True:
        return False
    saved = [then.get(s) for _, s in _FIGURES]
    return saved == [getattr(r, f) for f, _ in _FIGURES] and saved != [now.get(s) for _, s in _FIGURES]


def _live_rows(results: Path, shared: Path, traces: dict[str, Any]) -> list[str]:
    """Each live replay beside the simulator of this checkout. An npu_pool row whose live figures
    equal, every one, the simulation saved with the run (the ``simulated`` field) while this
    checkout's simulation differs from that saved one is npu_pool's own change since the run, not
    a fault of the simulator: "changed since" (a model of another allocator has no such excuse)."""
    from npu_pool.live import LiveResult, simulated

    rows = ["| trace | allocator | peak reserved: live / sim (bytes) | minimum capacity: live / sim (bytes) | "
            "device allocations: live / sim | same |", "|---|---|---|---|---|---|"]
    same_all = total = 0
    notes: list[str] = []
    changed: list[str] = []
    for f in sorted(results.glob("live_*.json")):
        for rec in json.loads(f.read_text()):
            then = rec.pop("simulated", None) or {}
            r = LiveResult(**rec)
            name = r.trace.split(".")[0]
            trace = traces.get(name)
            if trace is None:
                rows.append(f"| {r.trace} | {r.allocator} | (trace not in {shared}) | | | |")
                continue
            sim = simulated(trace, r)
            same = sim["same"]  # (the peaks, minimum capacity and device allocations: live.simulated)
            since = not same and r.allocator == "npu_pool" and _changed_since(r, then, sim)
            same_all += same
            total += 1
            rows.append(f"| {name} | {r.allocator} | {r.peak_reserved_bytes} / "
                        f"{sim['peak_reserved_bytes']} | {r.min_capacity_bytes} / {sim['min_capacity_bytes']} | "
                        f"{r.device_allocs} / {sim['device_mallocs']} | "
                        f"{'yes' if same else 'changed since' if since else 'NO'} |")
            if since:
                changed.append(name)
            elif not same:  # (what the columns do not show: the peak allocated, the failing event)
                notes.append(f"{name}, {r.allocator}: peak allocated {r.peak_allocated_bytes} live, "
                             f"{sim['peak_allocated_bytes']} simulated; ran out at event "
                             f"{r.fail_index if not r.ok else '-'} live, {sim['fail_index'] or '-'} simulated.")
    summary = (f"Every figure equal (peak reserved and allocated, minimum capacity, device allocations) "
               f"on {same_all} of {total} rows.")
    if changed:
        summary = (summary[:-1] + f"; on {len(changed)} more (npu_pool: {', '.join(changed)}) the live run "
                   f"equals the simulation saved with it, and npu_pool places differently since (its figures "
                   f"now in the sim columns).")
    return rows + ["", summary] + notes


def _training(results: Path) -> list[str]:
    from gpu_check import table

    out = []
    for name in ("gpt_small", "gpt_large", "mcore"):
        f = results / f"{name}.json"
        if not f.is_file():
            continue
        d = json.loads(f.read_text())
        text, _ = table(argparse.Namespace(**d["args"]), d["runs"])
        out += [f"### {name}", "", text, ""]
    return out


def _repeats(results: Path) -> list[str]:
    from gpu_check import median_step

    rows = ["| run | npu_pool policy | native median step (ms) | npu_pool median step (ms) | ratio |",
            "|---|---|---:|---:|---:|"]
    for f in sorted(results.glob("repeat_*.json")) + [results / "gpt_small.json"]:
        if not f.is_file():
            continue
        d = json.loads(f.read_text())
        med = {m: median_step(r["step_s"]) * 1e3 for m, r in d["runs"].items()}
        rows.append(f"| {f.stem} ({d['args']['steps']} steps) | {d['args']['policy']} | {med['native']:.2f} | "
                    f"{med['npu_pool']:.2f} | {med['npu_pool'] / med['native']:.3f} |")
    return rows


def _steady(results: Path, traces: dict[str, Any]) -> list[str]:
    """The calls and time of each iteration of a trace replayed on a full device (gpu_probe.py steady).
    The simulated calls are computed now, with this checkout, where the trace is at hand and cut into
    as many iterations as on the device (else, as the probe computed them then)."""
    from gpu_probe import simulate_capped

    from npu_pool.replay import iteration_bounds

    f = results / "steady.log"
    if not f.is_file():
        return []
    rows = ["| trace | allocator | cap (bytes) | calls per iteration: live | simulated | same | "
            "ms per iteration after the first (live, median of the plays) |", "|---|---|---:|---|---|---|---|"]
    as_then: list[str] = []
    changed: list[str] = []
    for line in f.read_text().splitlines():
        if not line.startswith("{"):
            continue
        d = json.loads(line)
        then = d["simulated_calls"]  # (the probe's simulation, saved with the run)
        trace = traces.get(d["trace"].split(".")[0])
        bounds = iteration_bounds(trace) if trace is not None else []
        compact = bool(d.get("compact"))  # (npu_pool with compaction: gpu_probe.py steady --compact)
        if bounds and len(bounds) + 1 == len(d["simulated_calls"]):
            rules = "npu" if d["device"] == "npu" else "cuda"
            _, d["simulated_calls"], compactions = simulate_capped(trace, d["allocator"], d["cap_bytes"], 1 << 40,
                                                                   rules, bounds, compact)
            # (compacting: the chunks the first play compacted are the simulator's too)
            d["same"] = d["simulated_calls"] == d["iteration_calls"] and (
                not compact or d.get("compactions") == compactions)
        else:
            as_then.append(f"{d['trace'].split('.')[0]} {d['allocator']}{', compacting' if compact else ''}")
        live = ", ".join(str(sum(c.values())) for c in d["iteration_calls"])
        sim = ", ".join(str(sum(c.values())) for c in d["simulated_calls"])
        ms = [statistics.median(c) * 1e3 for c in zip(*d["seconds"])]
        after = ", ".join(f"{x:.2f}" for x in ms[2:]) if d["ok"] else f"failed at event {d['fail']}"
        allocator = d["allocator"] + (", compacting" if compact else "")
        # npu_pool's own change since the run, as in the live table: the live calls equal the
        # simulation saved with the run, and this checkout's differs from that one
        since = not d["same"] and d["allocator"] == "npu_pool" and then == d["iteration_calls"] != d["simulated_calls"]
        if since:
            changed.append(f"{d['trace'].split('.')[0]} {allocator}")
        rows.append(f"| {d['trace'].split('.')[0]} | {allocator} | {d['cap_bytes']} | {live} | {sim} | "
                    f"{'yes' if d['same'] else 'changed since' if since else 'no'} | {after} |")
    if changed:
        rows += ["", "Changed since: the live calls equal the simulation saved with the run, and npu_pool places "
                 "differently since (this checkout's calls in the simulated column, not measured on a GPU): "
                 + ", ".join(changed) + "."]
    if as_then:
        rows += ["", "Simulated as the probe computed them on the device, not now (this checkout cuts the trace "
                 "into other iterations, or the trace is not at hand): " + ", ".join(as_then) + "."]
    return rows


def _capped(results: Path) -> list[str]:
    """The small model trained under a cap (gpu_check.py --cap-mib): device calls per step from the
    third on and the median step time."""
    from gpu_check import median_step

    files = sorted(results.glob("full_*.json")) + sorted(results.glob("ab*_*.json"))
    if not files:
        return []
    rows = ["| run | cap (MiB) | allocator | steps | device calls, steps 3+ | steps 3+ with calls | "
            "calls, last 20 steps | median step (ms) | peak reserved (bytes) |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for f in files:
        d = json.loads(f.read_text())
        for mode, r in d["runs"].items():
            later = r["step_calls"][2:]
            rows.append(f"| {f.stem} | {d['args']['cap_mib']} | {mode} | {len(r['step_calls'])} | {sum(later)} | "
                        f"{sum(1 for c in later if c)} | {sum(r['step_calls'][-20:])} | "
                        f"{median_step(r['step_s']) * 1e3:.2f} | {r['peak_reserved']} |")
    return rows


def _threads(results: Path) -> list[str]:
    """``gpu_probe.py threads`` runs (``threads_ALLOCATOR_N.json``), then the same workload on the
    simulator with this checkout (``threads --simulated``: a stream id per thread, taking turns)."""
    from gpu_probe import threads_simulated

    files = sorted(results.glob("threads_*.json"))
    if not files:
        return []
    rows = ["| run | allocator | requests after warm-up | device calls after warm-up | contents | "
            "timed rounds (s) | peak reserved (bytes) |", "|---|---|---:|---|---|---:|---:|"]

    def row(name: str, r: dict[str, Any]) -> str:
        if not r.get("requests_timed"):
            return f"| {name} | {r.get('allocator', '?')} | failed: {r.get('error', '?')} | | | | |"
        calls = ", ".join(f"{k} {v}" for k, v in sorted(r["calls_after_warm_up"].items())) or "none"
        if r.get("simulated"):  # (no contents; its seconds are this machine's, not the GPU's)
            return f"| {name} | {r['allocator']} | {r['requests_timed']} | {calls} | - | - | {r['peak_reserved']} |"
        contents = "intact" if r["ok"] else "WRONG: " + "; ".join(r["bad"])
        return (f"| {name} | {r['allocator']} | {r['requests_timed']} | {calls} | {contents} | "
                f"{r['seconds_timed']:.3f} | {r['peak_reserved']} |")

    runs = [json.loads(f.read_text()) for f in files]
    rows += [row(f.stem.split("_")[-1], r) for f, r in zip(files, runs)]
    n, rounds = runs[0].get("threads", 4), runs[0].get("rounds", 3)
    for allocator in ("native", "npu_pool"):
        rows.append(row("simulator, this checkout", threads_simulated(allocator, n, rounds)))
    return rows


def _compaction(results: Path) -> list[str]:
    """``gpu_probe.py compact`` runs (``compact_ALLOCATOR.json``): per round what empty_cache and
    compact() gave back, the live bytes compact() moved (each copied out to the host and back: twice
    that crosses the bus) and its time; then the queued-work round and the request at an
    out-of-memory."""
    files = sorted(results.glob("compact_*.json"))
    if not files:
        return []
    mib = 1 << 20
    rows = ["| allocator | round | tensors | allocated (bytes) | reserved (bytes) | after empty_cache | after compact() "
            "| moved (MiB) | empty_cache (s) | compact() (s) | GiB moved per s | contents |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    notes = []
    for f in files:
        d = json.loads(f.read_text())
        a = d["allocator"]
        for k, r in enumerate(d["rounds"], 1):
            copied, s = r.get("copied"), r.get("compact_s")
            rate = f"{copied / (1 << 30) / s:.2f}" if copied and s else "-"
            rows.append(f"| {a} | {k} | {r['tensors']} | {r['allocated']} | {r['reserved']} | {r['after_empty_cache']} | "
                        f"{r.get('after_compact', '-')} | {f'{copied / mib:.0f}' if copied is not None else '-'} | "
                        f"{r['empty_cache_s']:.3f} | {f'{s:.3f}' if s is not None else '-'} | {rate} | "
                        f"{'intact' if r['changed'] == 0 else str(r['changed']) + ' changed'} |")
        q, o = d.get("queued", {}), d.get("oom", {})
        if q:
            moves = f"{q['compactions']} compactions, " if "compactions" in q else ""
            notes.append(f"- {a}, work queued when it compacts: {q['tensors']} tensors inverted in place behind the "
                         f"matrix products, {moves}"
                         f"{'every tensor intact' if q['changed'] == 0 else str(q['changed']) + ' changed'}.")
        if o:
            with_it = (f"; with set_compaction(True) {'it fits' if o['fits_compacting'] else 'it does not fit'} "
                       f"({o['compactions']} compactions, {o['seconds']:.3f} s)") if "fits_compacting" in o else ""
            notes.append(f"- {a}, capped at {o['cap']} bytes with {o['allocated']} allocated, a request of {o['ask']}: "
                         f"{'fits' if o['fits'] else 'does not fit'} without compaction{with_it}; "
                         f"{'every tensor intact' if o['changed'] == 0 else str(o['changed']) + ' changed'}, "
                         f"{'intact' if d.get('changed_at_end') == 0 else 'changed'} after a last fill.")
    return rows + ([""] + notes if notes else [])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--shared", type=Path, default=ROOT.parent / "shared" / "traces")
    args = ap.parse_args(argv)
    if not args.results.is_dir():
        ap.error(f"{args.results} is not a folder of results")
    out: list[str] = []
    machine = args.results / "machine.txt"
    if machine.is_file():
        out += ["```text", machine.read_text().strip(), "```", ""]
    traces = _traces(args.shared)
    if args.shared.is_dir():
        out += ["## Live replay beside the simulator", ""] + _live_rows(args.results, args.shared, traces) + [""]
    training = _training(args.results)
    if training:
        out += ["## Training", ""] + training
    repeats = _repeats(args.results)
    if len(repeats) > 2:  # more than the header
        out += ["## Step time, repeated", ""] + repeats + [""]
    apis = args.results / "apis.json"
    if apis.is_file():
        from gpu_apis import report

        try:
            out += ["## torch.cuda's memory APIs", "", report(json.loads(apis.read_text())["runs"])[0], ""]
        except (ValueError, KeyError, TypeError) as e:
            ap.error(f"cannot read {apis}: {e}")
    try:
        moved = _compaction(args.results)
    except (ValueError, KeyError, TypeError) as e:
        ap.error(f"cannot read the compact_*.json files of {args.results}: {e}")
    if moved:
        out += ["## compact() on the device", ""] + moved + [""]
    four = _threads(args.results)
    if four:
        out += ["## Four threads, a stream each", ""] + four + [""]
    steady, capped = _steady(args.results, traces), _capped(args.results)
    if steady or capped:
        out += ["## A full device", ""]
    if steady:
        out += ["### Traces, iteration by iteration", ""] + steady + [""]
    if capped:
        out += ["### The small model, capped", ""] + capped + [""]
    costs = args.results / "costs.log"
    if costs.is_file():
        text = "\n".join(line for line in costs.read_text().splitlines() if not line.startswith("wrote "))
        out += ["## Device calls: microseconds per call", "", text.strip(), ""]
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
