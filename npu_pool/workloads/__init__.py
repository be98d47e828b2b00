"""Demo workloads for ``npu-pool capture`` and ``npu-pool demo``: the project's own GPT family
and, when ``transformers`` is installed, small Hugging Face models built from configs (never
downloaded weights). The product (pool, recorder, tools) does not import this package."""
from __future__ import annotations

import os
from typing import Any

from torch import nn

from .gpt import FLAVOURS, GPT, SHAPES, GPTConfig, make_config, param_count

__all__ = ["GPT", "GPTConfig", "FLAVOURS", "SHAPES", "MODEL_NAMES", "build_model", "make_config",
           "param_count", "prepare", "set_recompute", "have_transformers"]

HF_MODELS = ("hf-gpt2", "hf-llama", "hf-mixtral")
MODEL_NAMES: tuple[str, ...] = (*FLAVOURS, *HF_MODELS)


def have_transformers() -> bool:
    """Whether the optional ``transformers`` package can be imported."""
    try:
        import transformers  # noqa: F401
    except Exception:
        return False
    return True


def _hf_config(name: str, vocab: int, dim: int, n_layers: int, n_heads: int, max_seq: int) -> Any:
    import transformers as tf

    if name == "hf-gpt2":
        return tf.GPT2Config(vocab_size=vocab, n_embd=dim, n_layer=n_layers, n_head=n_heads,
                             n_positions=max_seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    common = dict(vocab_size=vocab, hidden_size=dim, num_hidden_layers=n_layers, num_attention_heads=n_heads,
                  num_key_value_heads=max(1, n_heads // 2), max_position_embeddings=max_seq)
    if name == "hf-llama":
        return tf.LlamaConfig(intermediate_size=dim * 8 // 3, **common)
    return tf.MixtralConfig(intermediate_size=dim, num_local_experts=4, num_experts_per_tok=2, **common)


def _build_hf(name: str, cfg: GPTConfig) -> nn.Module:
    if not have_transformers():
        raise ValueError(f"model {name!r} needs the optional 'transformers' package (pip install transformers)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers as tf

    hf_cfg = _hf_config(name, cfg.vocab, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.max_seq)
    hf_cfg.use_cache = False
    model = tf.AutoModelForCausalLM.from_config(hf_cfg)
    return _HFWrapper(model)


class _HFWrapper(nn.Module):
    """Gives a Hugging Face causal LM the GPT calling convention ``(idx, targets) -> loss``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.hf = model

    def forward(self, idx: Any, targets: Any = None) -> Any:
        out = self.hf(input_ids=idx, labels=None if targets is None else idx)
        return out.logits if targets is None else out.loss


def prepare(name: str) -> None:
    """Import what building ``name`` needs, so that a profiled set-up times the build,
    not Python imports (transformers loads model modules lazily)."""
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)}")
    if name in HF_MODELS and have_transformers():
        import transformers as tf

        cls = {"hf-gpt2": "GPT2LMHeadModel", "hf-llama": "LlamaForCausalLM", "hf-mixtral": "MixtralForCausalLM"}
        getattr(tf, cls[name])
        _hf_config(name, 64, 16, 1, 2, 64)


def build_model(name: str, **overrides: Any) -> nn.Module:
    """Build model ``name`` (see MODEL_NAMES) with GPTConfig field ``overrides``."""
    if name in HF_MODELS:
        cfg = make_config("gpt", **overrides)
        return _build_hf(name, cfg)
    return GPT(make_config(name, **overrides))


def set_recompute(model: nn.Module, on: bool) -> None:
    """Turn per-block activation checkpointing (non-reentrant) on or off."""
    if isinstance(model, _HFWrapper):
        if not on:
            return  # Hugging Face models start with checkpointing off
        hf = model.hf
        if hasattr(hf, "activation_checkpointing_enable"):  # transformers >= 5
            hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(model, "recompute"):
        model.recompute = on
    elif on:
        raise ValueError(f"{type(model).__name__} does not support recompute")


