"""GPU check: a real GPT training loop on CUDA, once with torch's native caching allocator
and once with npu_pool installed as the pluggable allocator, each in its own process.

    python benchmarks/gpu_check.py [--steps 30] [--policy npu_pool] [--flavour gpt]
                                   [--dim 512] [--layers 8] [--heads 8] [--batch 8] [--seq 512]

Prints a markdown table: whether the losses are identical (same seeds, deterministic
kernels), peak reserved and peak allocated bytes with the utilization (allocated /
reserved) of each allocator, the mean step time and its ratio, and nanoseconds per
malloc+free pair through torch's allocator interface. Exits 2 with a message when no
CUDA GPU is usable, 1 when the losses differ or a run fails.

The model is ``npu_pool.workloads.gpt`` when it is importable, else a small GPT defined here.
``--device cpu`` runs the same loop on the CPU with the native allocator in both processes:
it checks this script, not the allocator.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODES = ("native", "npu_pool")


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--policy", default="npu_pool", help="npu_pool policy: npu_pool, torch or expandable")
    ap.add_argument("--fraction", type=float, default=None, help="npu_pool memory fraction cap")
    ap.add_argument("--flavour", default="gpt", help="npu_pool.workloads.gpt flavour: gpt, llama, moe")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--pairs", type=int, default=20000, help="malloc+free pairs for the latency figure")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help=argparse.SUPPRESS)
    ap.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# ---- the model ---------------------------------------------------------------------------

def _model(args: argparse.Namespace) -> Any:
    """``npu_pool.workloads.gpt.GPT`` if present, else the small GPT below."""
    try:
        from npu_pool.workloads.gpt import GPT, make_config
    except ImportError:
        return _TinyGPT(args.vocab, args.dim, args.layers, args.heads, args.seq), "benchmarks/gpu_check.py:_TinyGPT"
    cfg = make_config(args.flavour, dim=args.dim, n_layers=args.layers, n_heads=args.heads, vocab=args.vocab,
                      max_seq=args.seq)
    return GPT(cfg), f"npu_pool.workloads.gpt ({args.flavour})"


def _TinyGPT(vocab: int, dim: int, layers: int, heads: int, seq: int) -> Any:
    """A pre-norm decoder-only transformer; ``forward(idx, targets)`` returns the loss."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class TinyGPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
            self.blocks = nn.ModuleList(
                nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
                for _ in range(layers))
            self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

        def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            n = idx.shape[1]
            x = self.tok(idx) + self.pos(torch.arange(n, device=idx.device))
            mask = nn.Transformer.generate_square_subsequent_mask(n, device=idx.device)
            for block in self.blocks:
                x = block(x, src_mask=mask, is_causal=True)
            return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1).float(), targets.flatten())

    return TinyGPT()


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


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    pools = None
    if args.worker == "npu_pool" and args.device == "cuda":
        import npu_pool  # installed before torch touches the GPU

        pools = npu_pool.install(device_type="cuda", policy=args.policy, fraction=args.fraction)
    import torch

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model, model_name = _model(args)
    dev = torch.device(args.device)
    model = model.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen) for _ in range(args.steps)]
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    losses, times = [], []
    for batch in batches:
        x, y = batch[:, :-1].to(dev), batch[:, 1:].to(dev)
        sync()
        t0 = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    out: dict[str, Any] = {"losses": losses, "step_s": times, "model": model_name, "torch": torch.__version__}
    if args.device == "cuda":
        out["device_name"] = torch.cuda.get_device_name()
        if pools is not None:  # torch.cuda.memory_stats is not supported under a pluggable allocator
            st = pools[torch.cuda.current_device()].stats()
            out.update(peak_reserved=st["total"]["reserved"]["peak"], peak_allocated=st["total"]["allocated"]["peak"],
                       allocs=st["allocs"], vmm=st["vmm"])
        else:
            out.update(peak_reserved=torch.cuda.max_memory_reserved(), peak_allocated=torch.cuda.max_memory_allocated())
        del model, opt, batches
        out["pair_ns"] = _pair_ns(torch, args.pairs)
    return out


# ---- the parent: two runs and the table ---------------------------------------------------------

def _run(mode: str, argv: list[str]) -> dict[str, Any]:
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, __file__, *argv, "--worker", mode], env=env, capture_output=True, text=True)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    sys.stderr.write(f"gpu_check: the {mode} run failed (exit {r.returncode}):\n{r.stderr[-4000:]}\n")
    raise SystemExit(1)


def _bytes(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def _table(args: argparse.Namespace, res: dict[str, dict[str, Any]]) -> tuple[str, bool]:
    nat, np_ = res["native"], res["npu_pool"]
    same = nat["losses"] == np_["losses"]
    diff = max(abs(a - b) for a, b in zip(nat["losses"], np_["losses"]))
    warm = slice(min(2, args.steps - 1), None)  # the first steps include one-off start-up work
    step = {m: sum(r["step_s"][warm]) / len(r["step_s"][warm]) for m, r in res.items()}
    label = f"npu_pool (policy {args.policy})" if args.device == "cuda" else "second run (CPU, native)"
    rows = [f"| | native (torch caching allocator) | {label} |", "|---|---|---|",
            f"| losses identical ({args.steps} steps) | {'yes' if same else f'NO (max abs diff {diff:.3g})'} | |",
            f"| final loss | {nat['losses'][-1]:.6f} | {np_['losses'][-1]:.6f} |"]
    if args.device == "cuda":
        for key, name in (("peak_reserved", "peak reserved"), ("peak_allocated", "peak allocated")):
            rows.append(f"| {name} | {_bytes(nat[key])} | {_bytes(np_[key])} |")
        util = {m: r["peak_allocated"] / r["peak_reserved"] if r["peak_reserved"] else 0.0 for m, r in res.items()}
        rows.append(f"| utilization (peak allocated / peak reserved) | {util['native']:.1%} | {util['npu_pool']:.1%} |")
    rows.append(f"| mean step time | {step['native'] * 1e3:.2f} ms | {step['npu_pool'] * 1e3:.2f} ms "
                f"(x{step['npu_pool'] / step['native']:.3f}) |")
    if args.device == "cuda":
        rows.append(f"| malloc+free per pair (torch.cuda.caching_allocator_alloc/delete) | "
                    f"{nat['pair_ns']:.0f} ns | {np_['pair_ns']:.0f} ns |")
    head = (f"GPU check on {nat.get('device_name', 'CPU')}, torch {nat['torch']}, model {nat['model']}, "
            f"dim {args.dim}, {args.layers} layers, batch {args.batch} x {args.seq}\n\n")
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
    res = {mode: _run(mode, argv) for mode in MODES}
    if args.device == "cuda" and not res["npu_pool"].get("allocs"):
        print("gpu_check: npu_pool served no allocation: the pluggable allocator was not in use", file=sys.stderr)
        return 1
    table, same = _table(args, res)
    print(table)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
