"""Demo workloads for ``npu-pool capture`` and ``npu-pool demo``: the project's own GPT family
(dense GPT, Llama-style, MoE). The product (pool, recorder, tools) does not import this package."""
from __future__ import annotations

from typing import Any

from torch import nn

from .gpt import FLAVOURS, GPT, SHAPES, GPTConfig, make_config, param_count

__all__ = ["GPT", "GPTConfig", "FLAVOURS", "SHAPES", "MODEL_NAMES", "build_model", "make_config",
           "param_count", "prepare", "set_recompute"]

MODEL_NAMES: tuple[str, ...] = tuple(FLAVOURS)


def prepare(name: str) -> None:
    """Check ``name`` before a profiled run starts (ValueError naming the known models)."""
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)}")


def build_model(name: str, **overrides: Any) -> nn.Module:
    """Build model ``name`` (see MODEL_NAMES) with GPTConfig field ``overrides``."""
    return GPT(make_config(name, **overrides))


def set_recompute(model: nn.Module, on: bool) -> None:
    """Turn per-block activation checkpointing (non-reentrant) on or off."""
    if hasattr(model, "recompute"):
        model.recompute = on
    elif on:
        raise ValueError(f"{type(model).__name__} does not support recompute")


