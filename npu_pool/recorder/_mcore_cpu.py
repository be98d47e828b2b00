"""Megatron-core models on CPU, for the recorder's tests and benchmarks.

megatron-core (``pip install megatron-core``) builds and trains its ``GPTModel``
(``TransformerBlock`` of ``TransformerLayer``, local layer spec) on CPU after two shims:
its global memory buffer and its RNG tracker ask ``torch.cuda`` for the device and RNG
state, so both are replaced by CPU versions. Its pipeline schedules and optimizers
allocate on ``"cuda"`` unconditionally and are not used here.
"""
from __future__ import annotations

import contextlib
import functools
import operator
import os
import socket
from typing import Any, Iterator, Optional

import torch


def available() -> bool:
    """Whether megatron-core can be imported."""
    try:
        import megatron.core  # noqa: F401
    except Exception:
        return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(seed: int = 0) -> None:
    """Process group (gloo; one process unless torchrun started several), model-parallel
    state (tensor and pipeline parallel 1: every rank is data parallel), CPU shims."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.utils import GlobalMemoryBuffer

    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)

    class CPUBuffer(GlobalMemoryBuffer):
        def get_tensor(self, tensor_shape: Any, dtype: Any, name: str, mem_alloc_context: Any = None) -> torch.Tensor:
            n = functools.reduce(operator.mul, tensor_shape, 1)
            buf = self.buffer.get((name, dtype))
            if buf is None or buf.numel() < n:
                buf = self.buffer[(name, dtype)] = torch.empty(n, dtype=dtype)
            return buf[:n].view(*tensor_shape)

    class CPUTracker(mrandom.CudaRNGStatesTracker):
        @contextlib.contextmanager
        def fork(self, name: Optional[str] = None) -> Iterator[None]:
            with torch.random.fork_rng(devices=[]):
                yield

    parallel_state._GLOBAL_MEMORY_BUFFER = CPUBuffer()
    mrandom._CUDA_RNG_STATE_TRACKER = CPUTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    torch.manual_seed(seed)


def gpt(layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 256, seq: int = 64) -> torch.nn.Module:
    """A megatron-core ``GPTModel`` built on CPU (call :func:`init` first)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                            use_cpu_initialization=True, pipeline_dtype=torch.float32, hidden_dropout=0.0,
                            attention_dropout=0.0)
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                    max_sequence_length=seq)


def batch(batch_size: int, seq: int, vocab: int, generator: Optional[torch.Generator] = None) -> dict[str, Any]:
    """Megatron's GPT batch: tokens, labels, position ids, causal mask (True = masked)."""
    tokens = torch.randint(vocab, (batch_size, seq + 1), generator=generator)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
            "position_ids": torch.arange(seq).unsqueeze(0).expand(batch_size, -1),
            "attention_mask": torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1)}


def loss(model: torch.nn.Module, b: dict[str, Any]) -> torch.Tensor:
    """Mean LM loss of one batch (GPTModel returns the per-token loss when given labels)."""
    out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])
    return out.float().mean()


# Megatron-LM's training module is not on PyPI (megatron-core is): tests and demos use this
# stand-in with the same names, signatures and call structure (pretrain ->
# setup_model_and_optimizer; train -> train_step per iteration and evaluate every
# eval_interval, both looked up as module globals as Megatron does). It trains whatever the
# model provider builds (megatron-core's GPTModel on CPU in the tests), data parallel through
# torch DDP (gloo) under torchrun; it needs only torch.
TRAINING_STANDIN = '''"""Stand-in for Megatron-LM's megatron/training/training.py (see npu_pool.recorder._mcore_cpu)."""
import torch


class MegatronOptimizer:
    """Megatron-style optimizer wrapper: step() returns (update_successful, grad_norm, num_zeros)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self):
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0)) if params else 0.0
        self.optimizer.step()
        return True, grad_norm, 0


def get_model(model_provider_func, model_type=None, wrap_with_ddp=True):
    model = model_provider_func()
    if wrap_with_ddp and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    return [model]


def setup_model_and_optimizer(model_provider_func, model_type=None, no_wd_decay_cond=None, scale_lr_cond=None,
                              lr_mult=1.0, checkpointing_context=None):
    model = get_model(model_provider_func, model_type)
    params = [p for m in model for p in m.parameters()]
    optimizer = MegatronOptimizer(torch.optim.AdamW(params, lr=1e-3, foreach=True))
    return model, optimizer, None


def forward_backward_no_pipelining(forward_step_func, data_iterator, model, num_microbatches, forward_only=False):
    losses = []
    for _ in range(num_microbatches):
        output, loss_func = forward_step_func(data_iterator, model[0])
        loss, stats = loss_func(output)
        if not forward_only:
            (loss / num_microbatches).backward()
        losses.append(stats)
    return losses


def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config):
    optimizer.zero_grad()
    losses = forward_backward_no_pipelining(forward_step_func, data_iterator, model, config["num_microbatches"])
    update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
    loss = sum(float(s["lm loss"]) for s in losses) / len(losses)
    return {"lm loss": loss}, not update_successful, False, False, 0, grad_norm, num_zeros_in_grad


def evaluate(forward_step_func, data_iterator, model, process_non_loss_data_func, config, verbose=False,
             non_loss_data_func=None):
    for m in model:
        m.eval()
    with torch.no_grad():
        losses = forward_backward_no_pipelining(forward_step_func, data_iterator, model, config["eval_iters"],
                                                forward_only=True)
    for m in model:
        m.train()
    return {"lm loss": sum(float(s["lm loss"]) for s in losses) / len(losses)}, None, False


def train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator, valid_data_iterator,
          process_non_loss_data_func, config):
    iteration = 0
    while iteration < config["train_iters"]:
        train_step(forward_step_func, train_data_iterator, model, optimizer, opt_param_scheduler, config)
        iteration += 1
        if config.get("eval_interval") and iteration % config["eval_interval"] == 0:
            evaluate(forward_step_func, valid_data_iterator, model, process_non_loss_data_func, config)
    return iteration


def pretrain(model_provider, forward_step_func, data_iterator, config):
    model, optimizer, opt_param_scheduler = setup_model_and_optimizer(model_provider, None)
    return train(forward_step_func, model, optimizer, opt_param_scheduler, data_iterator, data_iterator, None,
                 config), model, optimizer
'''


def write_training_standin(root: "os.PathLike[str] | str", *, without: tuple[str, ...] = ()) -> str:
    """Write the stand-in as ``<root>/megatron/training/training.py`` (``megatron`` stays the
    namespace package megatron-core installs) and return ``root`` for ``sys.path``.
    ``without``: function names to leave out (a Megatron version that lacks them)."""
    from pathlib import Path

    pkg = Path(root) / "megatron" / "training"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    text = TRAINING_STANDIN
    for name in without:
        text = text.replace(f"\ndef {name}(", f"\ndef _removed_{name}(")
    (pkg / "training.py").write_text(text)
    return str(root)


def forward_step(vocab: int, seq: int, batch_size: int) -> Any:
    """Megatron's ``forward_step(data_iterator, model) -> (output, loss_func)`` for GPTModel."""
    def step(data_iterator: Any, model: torch.nn.Module) -> Any:
        b = next(data_iterator)
        out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])

        def loss_func(output: torch.Tensor) -> Any:
            loss = output.float().mean()
            return loss, {"lm loss": loss.detach()}

        return out, loss_func

    return step


def data(vocab: int, seq: int, batch_size: int, seed: int = 0) -> Iterator[dict[str, Any]]:
    """Endless random GPT batches."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        yield batch(batch_size, seq, vocab, gen)
