"""``npu-pool demo``: the main job on the built-in default.

First the problem users have: one rank of a Llama-7B training run (tensor parallel 2,
fp32 weights and AdamW, three steps), traced on fake tensors in seconds, replayed on a
simulated 64 GiB NPU-sized device through PyTorch's allocator (a validated model), its
expandable segments, npu_pool and a plan made offline. Then proof that the recorder works
on real training: small models trained on this CPU and captured with torch.profiler, and
the real PyTorch snapshots in ../shared/traces when present, through every policy.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from ..progress import progress
from ..replay import evaluate, min_capacity, run as replay_run
from ..trace.format import forced_device
from . import policy_list
from .replay import LEGEND, add_device_argument, format_table

GiB = float(1 << 30)
SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "traces"
DEVICE = 64 << 30  # an Ascend 910B-sized device ...
CASE_RULES = "npu"  # ... with torch_npu's request rules (every request padded to round_up(r, 32) + 32)
# the case: one rank of Llama-7B with tensor parallelism 2, 3 steps of 1 x 1792 tokens (fake tensors)
CASE = dict(model_name="llama", shape="7b", steps=3, tp=2, batch=1, seq=1792)
# real CPU training captured with torch.profiler: a dense GPT, a Llama-style model with recompute, an MoE
WORKLOADS = [
    ("cpu-gpt-train", dict(model_name="gpt", steps=3)),
    ("cpu-llama-recompute", dict(model_name="llama", steps=3, recompute=True)),
    ("cpu-moe-accum2", dict(model_name="moe", steps=3, grad_accum=2)),
]
ABOUT = {"torch": "stock PyTorch allocator (model)", "expandable": "PyTorch, expandable_segments",
         "npu_pool": "npu_pool, online", "planned": "npu_pool + offline plan"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", default="torch,expandable,npu_pool", help="policies for the real traces' table, of torch, expandable, npu_pool")
    p.add_argument("--shared", default=None, metavar="DIR",
                   help="folder of real snapshots (*.pickle) to replay too (default: ../shared/traces beside the "
                        "checkout, skipped when absent; a folder named here must hold some)")
    p.add_argument("--no-capture", action="store_true", help="skip the CPU captures")
    p.add_argument("--no-case", action="store_true", help="skip the 7B case")
    add_device_argument(p)


def _case() -> list[str]:
    """The 7B case on a 64 GiB device, as lines of text."""
    from ..capture import fake_capture
    from ..planner import make_plan
    from ..trace.stats import live_profile

    trace = fake_capture(progress=False, **CASE)
    trace.meta["device_type"] = CASE_RULES  # the case is an Ascend card (--device overrides)
    plan = make_plan(trace, "llama-7b tp2")
    live = live_profile(trace).peak_bytes
    rows, needs = [], {}
    for policy in ("torch", "expandable", "npu_pool", "planned"):
        kw: dict[str, Any] = {"plan": plan} if policy == "planned" else {}
        on_device = replay_run(trace, policy, DEVICE, **kw)
        needs[policy], _ = min_capacity(trace, policy, no_retries=True, **kw)
        fits = "yes" if on_device.ok else "NO: out of memory"
        rows.append(f"  {policy:11} {fits:18} {on_device.peak_reserved_bytes / GiB:8.2f} {on_device.retries:8d} "
                    f"{needs[policy] / GiB:8.2f}   {ABOUT[policy]}")
    head = f"  {'policy':11} {'fits 64 GiB?':18} {'reserved':>8} {'retries':>8} {'needs':>8}"
    over = {p: round(n / GiB, 2) - round(live / GiB, 2) for p, n in needs.items()}  # as the table shows them
    return [
        "npu_pool demo: where does the memory go?",
        "",
        "One rank of Llama-7B training (tensor parallel 2, fp32 weights + AdamW, 3 steps of 1 x 1792",
        "tokens), traced on fake tensors (shapes only, no memory used), on a simulated 64 GiB Ascend",
        "device with torch_npu's request rules (each request padded to round_up(r, 32) + 32 bytes).",
        "",
        f"  peak live {live / GiB:.2f} GiB: the most bytes of tensors alive at once (the lower bound)",
        "",
        head,
        "  " + "-" * (len(head) - 2),
        *rows,
        "",
        "  fits 64 GiB?  whether the three steps complete on the 64 GiB device",
        "  reserved      the most memory the allocator held from the device at once there (GiB)",
        "  retries       how often a request failed there and the allocator gave its whole cache",
        "                back to the device (a device-wide synchronisation) to retry: each stalls",
        "  needs         the smallest device (GiB, 2 MiB steps) on which it runs with no retry",
        "",
        f"Beyond the tensors themselves, the stock allocator needs {over['torch']:.2f} GiB to run without",
        f"retries (freed blocks stay cached in segments other sizes cannot use); npu_pool needs",
        f"{over['npu_pool']:.2f} GiB (long-lived tensors apart from short-lived ones, one arena), a plan",
        f"made offline {over['planned']:.2f} GiB.",
    ]


def run(args: argparse.Namespace) -> int:
    with forced_device(args.device):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    policies = policy_list(args.policy, planned=False)  # (checked before any work; the 7B case plans its own)
    if not args.no_case:
        print("tracing a Llama-7B training step on fake tensors ...", flush=True)
        print("\n".join(_case()), flush=True)
    named = []
    if not args.no_capture:
        from ..capture import capture

        print("\nThe recorder on real training: small models trained on this CPU, captured with torch.profiler",
              flush=True)
        for i, (name, kwargs) in enumerate(WORKLOADS, 1):  # a line per model: each takes seconds
            print(f"  capturing {name} ({i}/{len(WORKLOADS)}) ...", end="", flush=True)
            t0 = time.perf_counter()
            named.append((name, capture(progress=False, **kwargs)))
            print(f" {time.perf_counter() - t0:.1f} s", flush=True)
    if args.shared == "":  # (an unset variable: not the current folder)
        raise ValueError("--shared '': an empty path")
    shared = SHARED if args.shared is None else Path(args.shared)
    snapshots = sorted(shared.glob("*.pickle")) if shared.is_dir() else []
    if args.shared is not None and not snapshots:  # named by the user: a mistake to say, not to skip
        why = "not a folder" if not shared.is_dir() else "no snapshots (*.pickle) in it"
        raise ValueError(f"--shared {args.shared!r}: {why}")
    if snapshots:
        from ..trace.files import open_traces

        print(f"and the real PyTorch snapshots of GPU training in {shared}:", flush=True)
        for path in snapshots:
            named.extend(open_traces(path))
    elif not args.no_capture:
        print(f"({shared} not found: a clone without ../shared replays the captured traces only)")
    if not named:
        print(f"nothing more to replay: --no-capture, and no snapshots in {shared}")
        return 0
    results = [evaluate(trace, name, policy)
               for name, trace in progress(named, desc="replay", unit="trace") for policy in policies]
    print(format_table(results))
    print(LEGEND)
    for policy in policies:
        rs = [r for r in results if r.policy == policy]
        waste = sum(r.min_capacity_bytes - r.peak_live_bytes for r in rs) / GiB
        print(f"{policy:11} needs {waste:.3f} GiB beyond peak live, summed over the {len(rs)} traces (over live)")
    print(NOTE)
    return 0


NOTE = """Read min cap for the memory each needs (here retries are allowed and counted; the 7B case's
"needs" allows none). peak rsvd and util are with room to spare, where npu_pool takes device
memory in chunks of at least 20 MiB, as PyTorch's large pool does, to make few device calls
(docs/device_calls.md): on models this small its util can be below the stock allocator's.
Request rules: each trace's own (CUDA's for the CPU captures) unless --device says otherwise."""
