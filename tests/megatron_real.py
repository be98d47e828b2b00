"""Drives the real Megatron-LM (``../shared/clients/megatron-lm``) and MindSpeed
(``../shared/clients/mindspeed``) under ``mindspeed_patch`` on this CPU machine; run in a
subprocess by tests/test_megatron_real.py (one JSON line of results on stdout).

    python tests/megatron_real.py wrapped  patch-first|megatron-first
    python tests/megatron_real.py train    START ITERS MICRO [SKIP_AT]    (also under torchrun)
    python tests/megatron_real.py setup
    python tests/megatron_real.py mindspeed patch-first|mindspeed-first

How far the real code runs on a CPU-only torch, and the three things put in its place:

- ``megatron.training.training.train_step`` runs whole: zero_grad, the forward/backward
  function, ``optimizer.step()``, the learning-rate scheduler, the loss reduction across
  data-parallel ranks (gloo). Its helpers ask ``torch.cuda.current_device()`` for where to
  put a scalar (``logical_and_across_model_parallel_group``); here that answers "cpu".
- ``schedules.forward_step`` / ``backward_step`` run for real, called through the module's
  globals by a one-micro-batch-at-a-time loop: the real ``forward_backward_no_pipelining``
  allocates ``torch.zeros([], device="cuda")`` on entry and cannot run without CUDA.
- The optimizer: Megatron's optimizers keep their state on CUDA; a torch AdamW with
  Megatron's ``step() -> (update_successful, grad_norm, num_zeros)`` contract stands in.
  Megatron's DDP allocates its grad buffers on the current CUDA device; model chunks are
  megatron-core GPTModels with ``zero_grad_buffer``.
- ``setup_model_and_optimizer`` stops in ``get_model`` at ``model_module.cuda(...)``.
"""
from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SHARED = Path(os.environ.get("NPU_POOL_SHARED", HERE.parents[1] / "shared"))
MEGATRON_LM = SHARED / "clients" / "megatron-lm"
MINDSPEED = SHARED / "clients" / "mindspeed"


class _TritonForMegatron(importlib.abc.MetaPathFinder):
    """Serves the triton stand-in (tests/stand_ins/triton) to Megatron's modules only: torch
    asks for triton too, and must go on finding none."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name.partition(".")[0] != "triton":
            return None
        f = sys._getframe(1)
        while f is not None and str(f.f_globals.get("__name__", "")).startswith(("importlib", "_frozen_importlib")):
            f = f.f_back
        importer = str(f.f_globals.get("__name__", "")) if f is not None else ""
        if not importer.startswith(("megatron.", "triton")):
            return None
        return importlib.machinery.PathFinder.find_spec(name, path or [str(HERE / "stand_ins")])


def _paths(mindspeed: bool) -> None:
    """The real sources first on the path, and the triton stand-in for Megatron's kernel
    modules. torch's compiler looks for triton when its modules load: they load first."""
    import torch._dynamo  # noqa: F401
    import torch._dynamo.repro.after_dynamo  # noqa: F401  (what torch.compile loads on first use)

    sys.path[:0] = [str(MEGATRON_LM)] + ([str(MINDSPEED)] if mindspeed else [])
    sys.meta_path.insert(0, _TritonForMegatron())
    import warnings

    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|deprecated|TE|fused).*")


def _cpu_device() -> None:
    """Megatron's scalar helpers put their tensor on ``torch.cuda.current_device()``."""
    import torch

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]


def _marks() -> list[tuple[str, int]]:
    """Every marker the default recorder sends from now on, as (name, argument)."""
    from npu_pool.recorder import default
    from npu_pool.vocab import MARK_NAMES

    seen: list[tuple[str, int]] = []
    default.listen(lambda code, arg: seen.append((MARK_NAMES[code], arg)))
    return seen


def _wrapped(module: Any, names: tuple[str, ...]) -> dict[str, bool]:
    return {n: bool(getattr(getattr(module, n), "__npu_pool_wrapped__", False)) for n in names}


def wrapped(order: str) -> dict[str, Any]:
    _paths(mindspeed=False)
    if order == "megatron-first":
        import megatron.training.training  # noqa: F401
    import mindspeed_patch  # noqa: F401
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.training.training as training

    out = {"training": _wrapped(training, ("setup_model_and_optimizer", "train_step", "evaluate")),
           "schedules": _wrapped(schedules, ("forward_step", "backward_step")),
           "file": training.__file__}
    from megatron.core.pipeline_parallel import schedules as again

    out["rebound"] = again.forward_step is schedules.forward_step
    return out


class _Optimizer:
    """Stands in for a MegatronOptimizer (whose state lives on CUDA): torch AdamW with
    Megatron's ``step() -> (update_successful, grad_norm, num_zeros_in_grad)``."""

    def __init__(self, params: Any, skip_at: int = -1):
        import torch

        self.optimizer = torch.optim.AdamW(params, lr=1e-3)
        self.param_groups = self.optimizer.param_groups
        self.chained_optimizers = [self]
        self.steps, self.skip_at = 0, skip_at

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> tuple[bool, Any, Any]:
        self.steps += 1
        if self.steps - 1 == self.skip_at:  # as when Megatron finds an overflow: no update
            return False, None, None
        self.optimizer.step()
        return True, 1.0, None


def _model(seq: int, vocab: int) -> Any:
    from npu_pool.recorder import _mcore_cpu as mc

    model = mc.gpt(layers=2, hidden=64, heads=4, vocab=vocab, seq=seq)

    def zero_grad_buffer() -> None:
        for p in model.parameters():
            p.grad = None

    model.zero_grad_buffer = zero_grad_buffer
    model.force_all_reduce = False
    return model


def _args(seq: int, micro_batch: int) -> Any:
    """The Megatron arguments train_step reads."""
    from types import SimpleNamespace

    return SimpleNamespace(
        save_dgrads_interval=None, save_wgrads_interval=None, reuse_grad_buf_for_mxfp8_param_ag=False,
        overlap_param_gather=False, seq_length=seq, micro_batch_size=micro_batch, decoder_seq_length=None,
        empty_unused_memory_level=0, vision_pretraining=False, barrier_with_L1_time=False, qk_clip=False,
        log_max_attention_logit=False, log_num_zeros_in_grad=False, data_parallel_size=1, curr_iteration=0,
        timing_log_level=0, timing_log_option="minmax", rerun_mode="disabled")


def train(start: int, iters: int, micro: int, skip_at: int) -> dict[str, Any]:
    _paths(mindspeed=False)
    import mindspeed_patch
    from mindspeed_patch.megatron import session

    seen = _marks()
    import torch
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.training.training as training
    from megatron.core.enums import ModelType
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.training import global_vars
    from npu_pool.recorder import _mcore_cpu as mc

    _cpu_device()
    mc.init(seed=0)
    rank = torch.distributed.get_rank()
    seq, vocab, batch = 32, 256, 2
    args = _args(seq, batch)
    global_vars.set_args(args)
    global_vars._set_timers(args)
    init_num_microbatches_calculator(rank, None, batch * micro, batch, 1)
    model = _model(seq, vocab)
    optimizer = _Optimizer(model.parameters(), skip_at)
    from npu_pool.recorder import attach

    attach([model], optimizer)  # what the set-up wrapper does with setup_model_and_optimizer's result
    scheduler = OptimizerParamScheduler(optimizer, init_lr=1e-3, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=0,
                                        lr_decay_steps=100, lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
                                        wd_incr_steps=100, wd_incr_style="constant")
    config = model.config
    forward_step_func = mc.forward_step(vocab, seq, batch)
    data = mc.data(vocab, seq, batch, seed=rank)

    def forward_backward(*, forward_step_func: Any, data_iterator: Any, model: Any, num_microbatches: int,
                         forward_only: bool = False, **_: Any) -> list[dict[str, Any]]:
        """One micro-batch at a time through the real forward_step/backward_step (module globals)."""
        store: list[dict[str, Any]] = []
        for k in range(num_microbatches):
            out, _tokens = schedules.forward_step(forward_step_func, data_iterator, model[0], num_microbatches,
                                                  None, store, config, 1, current_microbatch=k,
                                                  is_first_microbatch=k == 0)
            if not forward_only:
                schedules.backward_step(None, out, None, ModelType.encoder_or_decoder, config)
        return store

    losses, skipped = [], []
    for it in range(start, start + iters):
        args.curr_iteration = it
        result = training.train_step(forward_step_func, data, [model], optimizer, scheduler, config,
                                     forward_backward, iteration=it)
        losses.append(float(result[0]["lm loss"]))
        skipped.append(int(result[1]))
    s = session()
    report = s.report() if s is not None else {}
    mindspeed_patch.megatron.write_report()
    return {"rank": rank, "marks": seen, "losses": losses, "skipped": skipped,
            "report": {k: report.get(k) for k in ("iterations", "last_iteration", "skipped_iterations", "mode")}}


def setup() -> dict[str, Any]:
    """The real setup_model_and_optimizer: how far it gets, and the set-up phase around it."""
    _paths(mindspeed=False)
    import mindspeed_patch  # noqa: F401

    seen = _marks()
    import megatron.training.training as training
    from megatron.core.enums import ModelType
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args
    from npu_pool.recorder import _mcore_cpu as mc

    mc.init(seed=0)
    sys.argv = [sys.argv[0], "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
                "--lr", "1e-3", "--train-iters", "3", "--use-cpu-initialization"]
    args = parse_args()
    args.rank, args.world_size = 0, 1
    global_vars.set_args(args)
    global_vars._set_timers(args)
    error = None
    try:
        training.setup_model_and_optimizer(lambda **kw: mc.gpt(layers=2, hidden=64, heads=4, vocab=256, seq=32),
                                           ModelType.encoder_or_decoder)
    except BaseException as e:  # noqa: BLE001 -- the point is to say which call stops it
        import traceback

        frames = traceback.extract_tb(e.__traceback__)
        error = {"type": type(e).__name__, "message": str(e)[:200],
                 "stops_in": [f"{Path(f.filename).name}:{f.name}" for f in frames if "megatron" in f.filename][-2:]}
    return {"marks": seen, "error": error}


def mindspeed(order: str) -> dict[str, Any]:
    """MindSpeed's real patch manager: a full replacement and a wrapper of train_step, with
    mindspeed_patch imported before or after MindSpeed applies its patches."""
    _paths(mindspeed=True)
    calls: list[str] = []
    from mindspeed.patch_utils import MindSpeedPatchesManager as pm

    def train_step(*args: Any, **kwargs: Any) -> Any:  # a MindSpeed feature's replacement (dualpipe-like)
        calls.append("replacement")
        return {}, 0, False, False, 0, None, None, 0

    def train_step_wrapper(fn: Any) -> Any:  # a MindSpeed feature's wrapper (profile-like)
        def inner(*args: Any, **kwargs: Any) -> Any:
            calls.append("mindspeed wrapper")
            return fn(*args, **kwargs)
        return inner

    def mindspeed_applies() -> None:
        pm.register_patch("megatron.training.training.train_step", train_step)
        pm.register_patch("megatron.training.training.train_step", train_step_wrapper)
        pm.apply_patches()

    if order == "mindspeed-first":
        mindspeed_applies()
        import mindspeed_patch  # noqa: F401
    else:
        import mindspeed_patch  # noqa: F401
        import megatron.training.training  # noqa: F401  (the import hook registers our wrappers)
        mindspeed_applies()
    seen = _marks()
    import megatron.training.training as training

    for it in (4, 5):
        training.train_step(None, None, [], None, None, None, None, iteration=it)
    from mindspeed_patch.megatron import session

    return {"calls": calls, "marks": seen, "iterations": session().iterations,
            "wrappers": [w.__name__ for w in pm.patches_info["megatron.training.training.train_step"].wrappers]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("wrapped", "train", "setup", "mindspeed"))
    ap.add_argument("rest", nargs="*")
    a = ap.parse_args()
    if a.what == "wrapped":
        out = wrapped(a.rest[0])
    elif a.what == "train":
        start, iters, micro = (int(x) for x in a.rest[:3])
        out = train(start, iters, micro, int(a.rest[3]) if len(a.rest) > 3 else -1)
    elif a.what == "setup":
        out = setup()
    else:
        out = mindspeed(a.rest[0])
    text = json.dumps(out)
    where = os.environ.get("MEGATRON_REAL_RESULTS")  # several ranks: one file each (stdout lines interleave)
    if where:
        Path(where, f"rank{out.get('rank', 0)}.json").write_text(text)
    else:
        print("RESULT " + text, flush=True)


if __name__ == "__main__":
    main()
