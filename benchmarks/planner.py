"""Planned mode against the online pool: write docs/planner_results.md.

    python benchmarks/planner.py [--shared ../shared/traces] [--no-captures] [--out docs/planner_results.md]

A second table plans one recorded step (a real CPU capture of the small models, first step) and
replays the same run's three real steps with it, as the plan would meet them: whether the planner
kept it, peak reserved with it against the online pool's, and release-and-retry events on the
device the online pool needs. A third replays each shared trace whose plan is kept with tensors the
recording did not have (4 KiB or 16 MiB: one kept from the 10th, 1000th or 3000th request on, or one
made at every 97th request and freed 5 requests later): peak reserved online and with the plan,
uncapped and on a device 1% above the online peak.

For fake captures of 7B/13B shapes (gpt, llama, moe; 2 and 3 steps; recompute; gradient
accumulation; tensor- and pipeline-parallel slices; no real memory, see
``npu_pool.capture.fake_capture``) and the shared traces, each planned from itself as
``npu-pool plan`` does: peak live (the lower bound); peak reserved of torch, npu_pool and
planned (the plan as the planner keeps it: a plan worse than the online pool runs online)
and of the plan installed regardless ("plan as made"); the plan's served / idle-range /
fallback counts; the planned policy's minimum capacity and its release-and-retry events
there; planning time. Every figure comes from this script.
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from npu_pool.planner import make_plan  # noqa: E402
from npu_pool.progress import progress  # noqa: E402
from npu_pool.replay import min_capacity, run  # noqa: E402
from fragmentation import snapshots  # noqa: E402

GiB = float(1 << 30)
# (name, fake_capture arguments): one rank of a 7B/13B training run, sequence 2048 unless said
CAPTURES: list[tuple[str, dict[str, Any]]] = [
    ("gpt-7b 2 steps", dict(model_name="gpt", shape="7b", steps=2)),
    ("gpt-7b 3 steps", dict(model_name="gpt", shape="7b", steps=3)),
    ("llama-7b 3 steps recompute", dict(model_name="llama", shape="7b", steps=3, recompute=True)),
    ("llama-7b 2 steps accum 2", dict(model_name="llama", shape="7b", steps=2, grad_accum=2)),
    ("llama-13b 2 steps tp 2", dict(model_name="llama", shape="13b", steps=2, tp=2)),
    ("llama-13b 3 steps tp 2 pp 4", dict(model_name="llama", shape="13b", steps=3, tp=2, pp=4)),
    ("moe-7b 3 steps", dict(model_name="moe", shape="7b", steps=3, seq=1024)),
]


def collect(shared: Path | None, captures: bool) -> list[tuple[str, Any]]:
    from npu_pool.trace.files import open_traces

    named: list[tuple[str, Any]] = []
    for p in snapshots(shared):
        named.extend(open_traces(p))
    if captures:
        from npu_pool.capture import fake_capture

        for name, kw in progress(CAPTURES, desc="capture", unit="trace"):
            named.append((name, fake_capture(progress=False, **kw)))
    return named


def measure(name: str, trace: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    plan = make_plan(trace, name)
    plan_s = time.perf_counter() - t0
    torch_r, online = run(trace, "torch"), run(trace, "npu_pool")
    planned = run(trace, "planned", plan=plan)
    cap, at_cap = min_capacity(trace, "planned", plan=plan)
    m = plan.meta
    return dict(trace=name, live=online.peak_live_bytes, torch=torch_r.peak_reserved_bytes,
                npu_pool=online.peak_reserved_bytes, planned=planned.peak_reserved_bytes,
                as_made=m["replay_reserved_bytes"], counts=m["replay_counts"], online=m.get("online", ""),
                min_cap=cap, retries=at_cap.retries, plan_s=plan_s, window=m["method"], positions=m["positions"])


# (name, capture arguments): the small CPU models, one step planned, three replayed
ONE_STEP: list[tuple[str, dict[str, Any]]] = [
    ("gpt", dict(model_name="gpt")),
    ("gpt accum 2", dict(model_name="gpt", grad_accum=2)),
    ("gpt accum 3", dict(model_name="gpt", grad_accum=3)),
    ("gpt recompute", dict(model_name="gpt", recompute=True)),
    ("llama bf16", dict(model_name="llama", mixed_precision="bf16")),
    ("moe", dict(model_name="moe")),
    ("moe accum 2", dict(model_name="moe", grad_accum=2)),
]


def one_step_rows() -> list[dict[str, Any]]:
    """Each model captured for one step and for three (same seed: the first step is the same),
    the one planned, the three replayed with the plan as kept."""
    from npu_pool.capture import capture

    rows = []
    for name, kw in progress(ONE_STEP, desc="one step", unit="model"):
        one, three = capture(steps=1, progress=False, **kw), capture(steps=3, progress=False, **kw)
        plan = make_plan(one, name)
        online, planned = run(three, "npu_pool"), run(three, "planned", plan=plan)
        tight = online.peak_reserved_bytes
        rows.append(dict(trace=name, kept=not plan.meta.get("online"), online=online.peak_reserved_bytes,
                         planned=planned.peak_reserved_bytes, counts=planned.stats.get("plan", {}),
                         retries=run(three, "planned", tight, plan=plan).retries,
                         online_retries=run(three, "npu_pool", tight).retries))
    return rows


def one_step_table(rows: list[dict[str, Any]]) -> str:
    out = ["| model | plan of step 1 | 3 steps: planned MiB | npu_pool MiB | planned / npu_pool | "
           "served / idle / fallback | retries on npu_pool's device (npu_pool's) |", "|" + "---|" * 7]
    for r in rows:
        c = r["counts"]
        out.append(f"| {r['trace']} | {'kept' if r['kept'] else 'online'} | {r['planned'] / (1 << 20):.1f} | "
                   f"{r['online'] / (1 << 20):.1f} | {r['planned'] / r['online']:.3f} | "
                   f"{c.get('served', 0)} / {c.get('idle', 0)} / {c.get('fallback', 0)} | "
                   f"{r['retries']} ({r['online_retries']}) |")
    return "\n".join(out)


# (request, bytes, every): `bytes` allocated before that request and kept; with `every`, before every
# such request and freed EXTRA_LIFE requests later
EXTRAS = ([(at, size, 0) for at in (10, 1000, 3000) for size in (4096, 16 << 20)]
          + [(97, size, 97) for size in (4096, 16 << 20)])
EXTRA_LIFE = 5


def _with_extra(trace: Any, policy: str, capacity: int, at: int, size: int, every: int = 0,
                plan: Any = None) -> int | None:
    """Peak reserved bytes of ``trace`` replayed through ``policy`` with ``size`` more bytes allocated
    before its ``at``-th request and kept (``every``: before every ``every``-th request, each freed
    EXTRA_LIFE requests later); None when a request fails. (Played here, not by
    ``replay.run``, which refuses a plan for a trace whose iteration differs from the plan's, as
    this one now does; tags and recorded failures are not played: extra_rows leaves such traces out.)"""
    from npu_pool import Pool
    from npu_pool.planner import install
    from npu_pool.pool import OutOfMemoryError
    from npu_pool.trace.format import OP_ALLOC, OP_EMPTY_CACHE, OP_FREE, OP_INIT_ALLOC, OP_MARK, device_type

    with Pool(policy, capacity=capacity, rules=device_type(trace)) as pool:
        if plan is not None:
            install(pool, plan)
        live, n, extra = {}, 0, []
        try:
            for op, cat, id_, sz, stream in zip(trace.op, trace.cat, trace.id, trace.size, trace.stream):
                if op in (OP_ALLOC, OP_INIT_ALLOC):
                    n += 1
                    if n == at or (every and n % every == 0):
                        extra.append((n + EXTRA_LIFE if every else None, pool.malloc(size)))
                    while extra and extra[0][0] is not None and extra[0][0] <= n:
                        pool.free(extra.pop(0)[1])
                    live[id_] = pool.malloc(sz, stream=stream)
                elif op == OP_FREE and id_ in live:
                    pool.free(live.pop(id_))
                elif op == OP_MARK:
                    pool.mark(cat, id_)
                elif op == OP_EMPTY_CACHE:
                    pool.empty_cache()
        except OutOfMemoryError:
            return None
        return int(pool.stats()["total"]["reserved"]["peak"])


def extra_rows(named: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    """Each trace whose plan is kept, replayed with each of EXTRAS (see the module's docstring)."""
    from npu_pool.trace.format import OP_OOM, OP_PAUSE, OP_REGION, OP_RESUME

    rows = []
    for name, trace in progress(named, desc="extra tensor", unit="trace"):
        if not set(trace.op).isdisjoint((OP_OOM, OP_PAUSE, OP_REGION, OP_RESUME)):
            continue  # (what _with_extra does not play)
        plan = make_plan(trace, name)
        if plan.meta.get("online"):
            continue
        for at, size, every in EXTRAS:
            online = _with_extra(trace, "npu_pool", 1 << 46, at, size, every)
            assert online is not None, name
            tight = online + online // 100
            rows.append(dict(trace=name, at=at, size=size, every=every, online=online,
                             tight=_with_extra(trace, "planned", tight, at, size, every, plan),
                             uncapped=_with_extra(trace, "planned", 1 << 46, at, size, every, plan)))
    return rows


def extra_table(rows: list[dict[str, Any]]) -> str:
    out = ["| trace | extra | npu_pool GiB | planned GiB | planned on npu_pool's peak + 1% |",
           "|---|---|---:|---:|---:|"]
    for r in rows:
        size = "4 KiB" if r["size"] < 1 << 20 else f"{r['size'] >> 20} MiB"
        tight = "out of memory" if r["tight"] is None else f"{r['tight'] / GiB:.3f}"
        when = (f"at every {r['every']}th, freed {EXTRA_LIFE} later" if r["every"] else f"kept from the {r['at']}th")
        out.append(f"| {r['trace']} | {size} {when} | {r['online'] / GiB:.3f} | {r['uncapped'] / GiB:.3f} | "
                   f"{tight} |")
    return "\n".join(out)


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| trace | iteration | peak live GiB | torch | npu_pool | planned | plan as made | served / idle / "
            "fallback | planned min cap GiB | retries there | plan s |")
    out = [head, "|" + "---|" * 11]
    for r in rows:
        c = r["counts"]
        ratio = lambda k: f"{r[k] / r['live']:.4f}" if r["live"] else "-"  # noqa: E731
        flag = " (online)" if r["online"] else ""
        out.append(f"| {r['trace']} | {r['window']}, {r['positions']} | {r['live'] / GiB:.3f} | {ratio('torch')} | "
                   f"{ratio('npu_pool')} | **{ratio('planned')}**{flag} | {ratio('as_made')} | "
                   f"{c.get('served', 0)} / {c.get('idle', 0)} / {c.get('fallback', 0)} | {r['min_cap'] / GiB:.3f} | "
                   f"{r['retries']} | {r['plan_s']:.2f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", type=Path, default=ROOT.parent / "shared" / "traces")
    ap.add_argument("--no-captures", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "planner_results.md")
    a = ap.parse_args()
    named = collect(a.shared, not a.no_captures)
    rows = [measure(n, t) for n, t in progress(named, desc="plan", unit="trace")]
    steps = [] if a.no_captures else one_step_rows()
    shared = {Path(p).stem for p in snapshots(a.shared)} if a.shared else set()
    extras = extra_rows([(n, t) for n, t in named if n.split(".")[0] in shared])
    never_worse = all(r["planned"] <= r["npu_pool"] for r in rows)
    online = [r for r in rows if r["online"]]
    text = f"""# Planned mode against the online pool (generated)

Written by `python benchmarks/planner.py` on {time.strftime('%Y-%m-%d')} ({platform.machine()},
Python {platform.python_version()}); do not edit by hand. Peak reserved bytes over peak live bytes of a full
replay on the simulated device (hints `markers`), each trace planned from itself (`npu-pool plan`). "planned"
is the plan as the planner keeps it: a plan that would reserve more than the online pool, or fail or retry
on the device the online pool needs, runs online (marked "(online)"; the planned policy is then the npu_pool
policy). "plan as made" installs the plan regardless. Counts are the plan as made.

{table(rows)}

Planned reserves no more than npu_pool on every trace: **{never_worse}**. Plans kept online:
{len(online)} of {len(rows)}{''.join(f'; {r["trace"]}: {r["online"]}' for r in online)}.
"""
    if steps:
        text += f"""
## One recorded step, three real steps

Each small model captured on this CPU for one step and for three (`npu-pool capture`, same seed), the one
step planned (a whole-trace plan), the three steps replayed with the plan as kept ("online": the planner
kept it online, so the planned policy is npu_pool). Planned reserves no more than npu_pool on every run:
**{all(r['planned'] <= r['online'] for r in steps)}**; no more release-and-retry events on the device
npu_pool needs: **{all(r['retries'] <= r['online_retries'] for r in steps)}**.

{one_step_table(steps)}
"""
    if extras:
        text += f"""
## A kept plan meeting tensors the recording did not have

Each shared trace whose plan is kept, replayed with one extra tensor kept from its 10th, 1000th or
3000th request on (one the run keeps that the recorded step did not make: a logged value, a cache), or
with one made before every 97th request and freed {EXTRA_LIFE} requests later (a short-lived one the
recording did not have): peak reserved online, with the plan, and with the plan on a device 1% above
the online pool's peak.
Never out of memory there: **{all(r['tight'] is not None for r in extras)}**; planned no more than
npu_pool: **{sum(r['uncapped'] <= r['online'] for r in extras)} of {len(extras)}**.

{extra_table(extras)}
"""
    a.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
