"""GPU check: a real training loop on CUDA, once with torch's native caching allocator and once
with npu_pool installed as the pluggable allocator, each in its own process.

    python benchmarks/gpu_check.py [--steps 30] [--model gpt|mcore] [--dtype fp32|bf16]
                                   [--dim 512] [--layers 8] [--heads 8] [--batch 8] [--seq 512]
                                   [--max-batch] [--cap-mib MIB] [--record SNAPSHOT] [--json FILE]

Prints a markdown table: whether the losses are identical step by step (same seeds,
deterministic kernels, attention through the math kernel unless ``--attention auto``), peak
reserved and peak allocated bytes (over the run, and per step from the third on) with the
utilization (allocated / reserved) of each allocator, device calls from the third step on
(num_device_alloc + num_device_free for the native allocator; every memory call npu_pool
counts by kind for npu_pool), the median step time from the third step on and its ratio,
nanoseconds per malloc+free pair through torch's allocator interface, whether
``torch.cuda.memory_*`` answer with npu_pool installed (the byte counts checked against the
pool's own, the others for an answer) and, with ``--max-batch``, the largest batch each
allocator fits (doubling, then bisection; one training step per try).

``--model gpt`` is ``npu_pool.workloads.gpt``; ``--model mcore`` a megatron-core ``GPTModel``
(local layer spec) from ``--megatron`` (default ``../shared/clients/megatron-lm``). ``--dtype bf16``
trains under ``torch.autocast`` (bf16 compute, fp32 weights and AdamW states). ``--record FILE``
records a memory snapshot of the native run (``torch.cuda.memory._record_memory_history``) for
``npu-pool replay --validate``. ``--cap-mib MIB`` caps both allocators at MIB MiB (a full device:
``torch.cuda.set_per_process_memory_fraction``, which npu_pool follows). Exits 2 with a message
when no CUDA GPU is usable, 1 when the losses differ or a run fails. ``--device cpu`` runs the
loop on the CPU with the native allocator in both processes: it checks this script, not the
allocator.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
MODES = ("native", "npu_pool")
# npu_pool's calls that take or give back device memory or change mappings (vocab.CALL_NAMES)
MEMORY_CALLS = ("malloc", "free", "reserve", "release", "phys_create", "phys_release", "map", "unmap")


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--model", default="gpt", choices=("gpt", "mcore"))
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--attention", default="math", choices=("math", "auto"),
                    help="scaled_dot_product_attention backend: math (deterministic) or torch's choice")
    ap.add_argument("--policy", default="npu_pool", help="npu_pool policy: npu_pool, torch or expandable")
    ap.add_argument("--fraction", type=float, default=None, help="npu_pool memory fraction cap")
    ap.add_argument("--cap-mib", type=int, default=None,
                    help="cap both allocators at this many MiB (torch.cuda.set_per_process_memory_fraction)")
    ap.add_argument("--flavour", default="gpt", help="npu_pool.workloads.gpt flavour: gpt, llama, moe")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--pairs", type=int, default=20000, help="malloc+free pairs for the latency figure")
    ap.add_argument("--max-batch", action="store_true", help="find the largest batch each allocator fits")
    ap.add_argument("--megatron", default=str(ROOT.parent / "shared" / "clients" / "megatron-lm"),
                    help="a Megatron-LM checkout (for --model mcore)")
    ap.add_argument("--record", help="write a memory snapshot of the native run here (.pickle)")
    ap.add_argument("--json", help="write both runs' figures here")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help=argparse.SUPPRESS)
    ap.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps < 3 or args.batch < 1 or args.seq < 1 or args.pairs < 1:
        ap.error("--steps must be at least 3; --batch, --seq and --pairs positive")
    if args.cap_mib is not None and args.cap_mib < 1:
        ap.error("--cap-mib takes a positive number of MiB")
    return args


# ---- the models ----------------------------------------------------------------------------

def _gpt(args: argparse.Namespace) -> tuple[Any, str]:
    from npu_pool.workloads.gpt import GPT, make_config

    cfg = make_config(args.flavour, dim=args.dim, n_layers=args.layers, n_heads=args.heads, vocab=args.vocab,
                      max_seq=args.seq)
    return GPT(cfg), f"npu_pool.workloads.gpt ({args.flavour})"


def _mcore(args: argparse.Namespace, dev: Any) -> tuple[Any, str]:
    """A megatron-core GPTModel (local spec, tensor and pipeline parallel 1) whose
    ``forward(idx, targets)`` returns the mean loss, like the project's GPT."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, args.megatron)
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    if dev.type == "cpu":  # this script's own check: megatron-core's CPU shims
        from npu_pool.recorder._mcore_cpu import init

        init(0)
    else:
        if not dist.is_initialized():
            dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(0)
    cfg = TransformerConfig(num_layers=args.layers, hidden_size=args.dim, num_attention_heads=args.heads,
                            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0)
    inner = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.vocab,
                     max_sequence_length=args.seq)

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            n = idx.shape[1]
            pos = torch.arange(n, device=idx.device).unsqueeze(0).expand(idx.shape[0], -1)
            mask = torch.ones(1, 1, n, n, dtype=torch.bool, device=idx.device).triu(1)
            return inner(idx, pos, mask, labels=targets).float().mean()

    return Wrapped(), "megatron-core GPTModel (local spec)"


# ---- one run (a worker process) ----------------------------------------------------------------

def _pair_ns(torch: Any, pairs: int) -> float:
    """ns per malloc+free pair through torch's current allocator (mixed sizes, 64 live)."""
    rng = random.Random(0)
    sizes = [rng.choice((rng.randint(512, 64 << 10), rng.randint(64 << 10, 2 << 20), rng.randint(2 << 20, 16 << 20)))
             for _ in range(pairs)]
    alloc, delete = torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete
    live: list[int] = []
    t0 = time.perf_counter_ns()
    for size in sizes:
        live.append(alloc(size))
        if len(live) > 64:
            delete(live.pop(rng.randrange(len(live))))
    for p in live:
        delete(p)
    return (time.perf_counter_ns() - t0) / pairs


def _max_batch(step: Callable[[int], None], start: int, cleanup: Callable[[], None], tries: int = 9) -> dict[str, Any]:
    """The largest batch for which one training step runs: doubling from ``start``, then bisection."""
    from npu_pool.live import is_oom

    ok, bad, log = 0, None, []

    def fits(b: int) -> bool:
        try:
            step(b)
            good = True
        except (RuntimeError, MemoryError) as e:
            if not is_oom(e):
                raise
            good = False
        cleanup()
        log.append((b, good))
        return good

    b = start
    while bad is None and len(log) < tries:
        if fits(b):
            ok, b = b, b * 2
        else:
            bad = b
    while bad is not None and bad - ok > 1 and len(log) < tries:
        mid = (ok + bad) // 2
        if fits(mid):
            ok = mid
        else:
            bad = mid
    return {"largest": ok, "smallest_failed": bad, "tries": log}


def _memory_apis(torch: Any, pool: Any) -> dict[str, Any]:
    """Whether torch.cuda.memory_* answer under npu_pool, and with the pool's own figures."""
    st = pool.stats()["total"]
    out: dict[str, Any] = {}
    checks = {
        "memory_allocated": (lambda: torch.cuda.memory_allocated(), st["allocated"]["current"]),
        "memory_reserved": (lambda: torch.cuda.memory_reserved(), st["reserved"]["current"]),
        "max_memory_allocated": (lambda: torch.cuda.max_memory_allocated(), st["allocated"]["peak"]),
        "max_memory_reserved": (lambda: torch.cuda.max_memory_reserved(), st["reserved"]["peak"]),
        "memory_stats": (lambda: torch.cuda.memory_stats()["allocated_bytes.all.current"], st["allocated"]["current"]),
        "memory_summary": (lambda: len(torch.cuda.memory_summary()) > 0, True),
        "memory_snapshot": (lambda: isinstance(torch.cuda.memory_snapshot(), list), True),
        "mem_get_info": (lambda: torch.cuda.mem_get_info()[1] > 0, True),
    }
    for name, (call, want) in checks.items():
        try:
            got = call()
            out[name] = "ok" if got == want else f"differs: {got} vs the pool's {want}"
        except Exception as e:  # noqa: BLE001  (what a user would see is the finding)
            out[name] = f"raised {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return out


def _calls(torch: Any, pool: Any) -> int:
    """Device memory calls so far: the pool's by kind, or the native allocator's counters."""
    if pool is not None:
        c = pool.stats()["calls"]
        return sum(int(c[k]) for k in MEMORY_CALLS)
    st = torch.cuda.memory_stats()
    return int(st.get("num_device_alloc", 0)) + int(st.get("num_device_free", 0))


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    pools = None
    cuda = args.device == "cuda"
    if args.worker == "npu_pool" and cuda:
        import npu_pool  # installed before torch touches the GPU

        pools = npu_pool.install(device_type="cuda", policy=args.policy, fraction=args.fraction)
    import torch

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dev = torch.device(args.device)
    pool = pools[torch.cuda.current_device()] if pools else None
    if args.cap_mib and cuda:  # the pool floors fraction * total; half a byte survives float error
        total = torch.cuda.mem_get_info()[1]
        torch.cuda.set_per_process_memory_fraction(min(1.0, ((args.cap_mib << 20) + 0.5) / total))
    if args.record and args.worker == "native" and cuda:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    model, model_name = _mcore(args, dev) if args.model == "mcore" else _gpt(args)
    model = model.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    autocast = torch.autocast(device_type=args.device, dtype=torch.bfloat16, enabled=args.dtype == "bf16")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    attention = (lambda: sdpa_kernel([SDPBackend.MATH])) if args.attention == "math" else contextlib.nullcontext

    def train_step(batch: Any) -> float:
        x, y = batch[:, :-1].to(dev), batch[:, 1:].to(dev)
        with autocast, attention():
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.item())

    losses, times, peaks_r, peaks_a, calls = [], [], [], [], []
    for _ in range(args.steps):
        batch = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        c0 = _calls(torch, pool) if cuda else 0
        sync()
        t0 = time.perf_counter()
        losses.append(train_step(batch))
        sync()
        times.append(time.perf_counter() - t0)
        if cuda:
            peaks_r.append(int(torch.cuda.max_memory_reserved()))
            peaks_a.append(int(torch.cuda.max_memory_allocated()))
            calls.append(_calls(torch, pool) - c0)
    out: dict[str, Any] = {"losses": losses, "step_s": times, "model": model_name, "torch": torch.__version__,
                           "params": sum(p.numel() for p in model.parameters())}
    if not cuda:
        return out
    if args.record and args.worker == "native":
        torch.cuda.memory._dump_snapshot(args.record)
        torch.cuda.memory._record_memory_history(enabled=None)
    out.update(device_name=torch.cuda.get_device_name(), cuda=torch.version.cuda, step_peak_reserved=peaks_r,
               step_peak_allocated=peaks_a, step_calls=calls)
    if pool is not None:
        st = pool.stats()
        out.update(peak_reserved=st["total"]["reserved"]["peak"], peak_allocated=st["total"]["allocated"]["peak"],
                   allocs=st["allocs"], calls={k: int(v) for k, v in st["calls"].items() if v},
                   memory_apis=_memory_apis(torch, pool))
    else:
        st = torch.cuda.memory_stats()
        out.update(peak_reserved=st["reserved_bytes.all.peak"], peak_allocated=st["allocated_bytes.all.peak"],
                   calls={"num_device_alloc": int(st.get("num_device_alloc", 0)),
                          "num_device_free": int(st.get("num_device_free", 0))})
    if args.max_batch:
        def one(b: int) -> None:
            train_step(torch.randint(0, args.vocab, (b, args.seq + 1), generator=gen))

        def cleanup() -> None:
            opt.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()

        out["max_batch"] = _max_batch(one, args.batch, cleanup)
    del model, opt
    gc.collect()
    out["pair_ns"] = _pair_ns(torch, args.pairs)
    return out


# ---- the parent: two runs and the table ---------------------------------------------------------

def run_worker(mode: str, argv: list[str], script: str = __file__) -> dict[str, Any]:
    """Run ``script --worker MODE`` (deterministic cuBLAS) and return what it printed after ``RESULT``;
    exit 1 with the end of its stderr when it printed nothing."""
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, script, *argv, "--worker", mode], env=env, capture_output=True, text=True)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    sys.stderr.write(f"{Path(script).stem}: the {mode} run failed (exit {r.returncode}):\n{r.stderr[-4000:]}\n")
    raise SystemExit(1)


def _bytes(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def median_step(step_s: list[float]) -> float:
    """The median step time from the third step on (the first ones include one-off start-up work)."""
    warm = sorted(step_s[2:])
    return warm[len(warm) // 2]


def table(args: argparse.Namespace, res: dict[str, dict[str, Any]]) -> tuple[str, bool]:
    """The markdown table of both runs (``res``: their results by mode); and whether the losses match."""
    nat, np_ = res["native"], res["npu_pool"]
    same = nat["losses"] == np_["losses"]
    diff = max(abs(a - b) for a, b in zip(nat["losses"], np_["losses"]))
    first = next((i for i, (a, b) in enumerate(zip(nat["losses"], np_["losses"])) if a != b), None)
    warm = slice(2, None)  # the first steps include one-off start-up work
    step = {m: median_step(r["step_s"]) for m, r in res.items()}
    label = f"npu_pool (policy {args.policy})" if args.device == "cuda" else "second run (CPU, native)"
    rows = [f"| | native (torch caching allocator) | {label} |", "|---|---|---|",
            f"| losses identical, step by step ({args.steps} steps) | "
            f"{'yes' if same else f'NO (first at step {first}, max abs diff {diff:.3g})'} | |",
            f"| final loss | {nat['losses'][-1]:.6f} | {np_['losses'][-1]:.6f} |"]
    if args.device == "cuda":
        for key, name in (("peak_reserved", "peak reserved"), ("peak_allocated", "peak allocated")):
            rows.append(f"| {name} | {_bytes(nat[key])} ({nat[key]} B) | {_bytes(np_[key])} ({np_[key]} B) |")
        util = {m: r["peak_allocated"] / r["peak_reserved"] if r["peak_reserved"] else 0.0 for m, r in res.items()}
        rows.append(f"| utilization (peak allocated / peak reserved) | {util['native']:.1%} | {util['npu_pool']:.1%} |")
        for key, name in (("step_peak_reserved", "per-step peak reserved, steps 3+ (min..max)"),
                          ("step_peak_allocated", "per-step peak allocated, steps 3+ (min..max)")):
            rows.append(f"| {name} | " + " | ".join(
                f"{_bytes(min(r[key][warm]))} .. {_bytes(max(r[key][warm]))}" for r in (nat, np_)) + " |")
        rows.append("| device memory calls in steps 3+ (all / per step max) | " + " | ".join(
            f"{sum(r['step_calls'][warm])} / {max(r['step_calls'][warm])}" for r in (nat, np_)) + " |")
        rows.append("| device memory calls, whole run | " + " | ".join(
            ", ".join(f"{k} {v}" for k, v in r["calls"].items()) or "none" for r in (nat, np_)) + " |")
    rows.append(f"| median step time, steps 3+ | {step['native'] * 1e3:.2f} ms | {step['npu_pool'] * 1e3:.2f} ms "
                f"(x{step['npu_pool'] / step['native']:.3f}) |")
    if args.device == "cuda":
        rows.append(f"| malloc+free per pair (torch.cuda.caching_allocator_alloc/delete) | "
                    f"{nat['pair_ns']:.0f} ns | {np_['pair_ns']:.0f} ns |")
        apis = np_.get("memory_apis", {})
        bad = {k: v for k, v in apis.items() if v != "ok"}
        rows.append(f"| torch.cuda.memory_* under npu_pool | | "
                    f"{'all ' + str(len(apis)) + ' answer (byte counts: the pool figures)' if not bad else bad} |")
        if "max_batch" in nat:
            rows.append("| largest batch (one step fits; tries) | " + " | ".join(
                f"{r['max_batch']['largest']} ({len(r['max_batch']['tries'])})" for r in (nat, np_)) + " |")
    head = (f"GPU check on {nat.get('device_name', 'CPU')}, torch {nat['torch']}, model {nat['model']} "
            f"({nat['params'] / 1e6:.0f} M parameters), {args.dtype}, dim {args.dim}, {args.layers} layers, "
            f"batch {args.batch} x {args.seq}, attention {args.attention}\n\n")
    return head + "\n".join(rows), same


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _args(argv)
    if args.worker:
        print("RESULT " + json.dumps(_worker(args)), flush=True)
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        why = "a CPU-only build" if torch.version.cuda is None else "a CUDA build, but no GPU is visible"
        print(f"gpu_check: no CUDA GPU is usable here (torch {torch.__version__} is {why}); run this on a machine "
              "with an NVIDIA GPU and a CUDA build of torch.", file=sys.stderr)
        return 2
    res = {mode: run_worker(mode, argv) for mode in MODES}
    if args.device == "cuda" and not res["npu_pool"].get("allocs"):
        print("gpu_check: npu_pool served no allocation: the pluggable allocator was not in use", file=sys.stderr)
        return 1
    text, same = table(args, res)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "runs": res}, f)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
