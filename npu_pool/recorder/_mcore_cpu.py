"""Megatron-core models on CPU, for the recorder's tests and benchmarks (and the tests that drive
the real Megatron-LM training functions, tests/megatron_real.py).

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


def forward_step(vocab: int, seq: int, batch_size: int) -> Any:
    """Megatron's ``forward_step(data_iterator, model) -> (output, loss_func)`` for GPTModel, its
    loss function as Megatron-LM's ``pretrain_gpt.py`` writes it: the summed per-token losses,
    the token count, and both for reporting (which ``train_step`` reduces across data-parallel ranks)."""
    def step(data_iterator: Any, model: torch.nn.Module) -> Any:
        b = next(data_iterator)
        out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])

        def loss_func(output: torch.Tensor) -> Any:
            loss = output.float().sum()
            tokens = torch.tensor(output.numel(), dtype=torch.int)
            return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.float()])}

        return out, loss_func

    return step


def data(vocab: int, seq: int, batch_size: int, seed: int = 0) -> Iterator[dict[str, Any]]:
    """Endless random GPT batches."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        yield batch(batch_size, seq, vocab, gen)
