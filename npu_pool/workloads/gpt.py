"""The project's own small decoder-only transformer (GPT / Llama / MoE flavours).

One module family, configured by :class:`GPTConfig`: token embedding, ``n_layers``
blocks in the ``nn.ModuleList`` ``layers`` (pre-norm attention + MLP), final norm and
LM head. ``norm`` picks LayerNorm or RMSNorm, ``mlp`` GELU or SwiGLU, ``rope``
rotary position embedding instead of a learned one, and ``n_experts > 0`` a
mixture-of-experts MLP with top-k routing (routed batch sizes vary per step).

``tp`` slices the layer as Megatron tensor parallelism would on one rank: attention
heads, KV heads, the MLP hidden size and the vocabulary are divided by ``tp`` while
the residual width ``dim`` stays whole (no communication is modelled).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class GPTConfig:
    """Shape and flavour of a :class:`GPT`."""

    vocab: int = 512
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: same as n_heads (multi-head attention)
    ffn: int | None = None  # MLP hidden size; None: 4*dim (gelu) or ~8/3*dim (swiglu)
    max_seq: int = 1024
    norm: str = "layernorm"  # or "rmsnorm"
    mlp: str = "gelu"  # or "swiglu"
    rope: bool = False
    bias: bool = True
    n_experts: int = 0  # >0: MoE MLP
    top_k: int = 2
    tp: int = 1  # tensor-parallel degree this rank's slice is built for

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.ffn:
            return self.ffn
        if self.mlp == "swiglu":
            return 64 * math.ceil(8 * self.dim / 3 / 64)
        return 4 * self.dim

    def local(self) -> "GPTConfig":
        """Check divisibility by ``tp``; return self."""
        for name, v in (("n_heads", self.n_heads), ("kv_heads", self.kv_heads), ("ffn", self.ffn_dim),
                        ("vocab", self.vocab)):
            if v % self.tp:
                raise ValueError(f"{name}={v} is not divisible by tp={self.tp}")
        if self.dim % self.n_heads or self.n_heads % self.kv_heads:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}, "
                             f"and n_heads by the kv heads ({self.kv_heads})")
        return self


def param_count(cfg: GPTConfig) -> int:
    """Analytical number of parameters of ``GPT(cfg)`` on one tensor-parallel rank."""
    tp, d, hd = cfg.tp, cfg.dim, cfg.head_dim
    b = 1 if cfg.bias else 0
    q, kv, f = cfg.n_heads // tp * hd, cfg.kv_heads // tp * hd, cfg.ffn_dim // tp
    norm = d * (1 if cfg.norm == "rmsnorm" else 2)
    attn = d * (q + 2 * kv) + b * (q + 2 * kv) + q * d + b * d
    n_in = 2 if cfg.mlp == "swiglu" else 1
    expert = d * f * n_in + b * f * n_in + f * d + b * d
    mlp = expert * cfg.n_experts + d * cfg.n_experts if cfg.n_experts else expert
    emb = cfg.vocab // tp * d + (0 if cfg.rope else cfg.max_seq * d)
    return emb + cfg.n_layers * (2 * norm + attn + mlp) + norm + d * (cfg.vocab // tp)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Llama)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _norm(cfg: GPTConfig) -> nn.Module:
    return RMSNorm(cfg.dim) if cfg.norm == "rmsnorm" else nn.LayerNorm(cfg.dim, bias=cfg.bias)


def _rope_tables(seq: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of rotary embedding, (seq, head_dim / 2)."""
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ang = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    return ang.cos(), ang.sin()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, heads, seq, head_dim) pairs by the first ``seq`` rows of the tables."""
    seq = x.shape[-2]
    cos, sin = cos[:seq].to(x.dtype), sin[:seq].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    """Causal self-attention (grouped-query when ``n_kv_heads < n_heads``)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.h, self.kv = cfg.n_heads // cfg.tp, cfg.kv_heads // cfg.tp
        hd = cfg.head_dim
        self.qkv = nn.Linear(cfg.dim, (self.h + 2 * self.kv) * hd, bias=cfg.bias)
        self.proj = nn.Linear(self.h * hd, cfg.dim, bias=cfg.bias)
        if cfg.rope:  # per-layer copies, built once (like GPT-NeoX); not parameters
            cos, sin = _rope_tables(cfg.max_seq, hd)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        hd = self.cfg.head_dim
        q, k, v = self.qkv(x).split((self.h * hd, self.kv * hd, self.kv * hd), dim=-1)
        q = q.view(b, s, self.h, hd).transpose(1, 2)
        k = k.view(b, s, self.kv, hd).transpose(1, 2)
        v = v.view(b, s, self.kv, hd).transpose(1, 2)
        if self.cfg.rope:
            q, k = _rope(q, self.rope_cos, self.rope_sin), _rope(k, self.rope_cos, self.rope_sin)
        if self.kv != self.h:
            k = k.repeat_interleave(self.h // self.kv, dim=1)
            v = v.repeat_interleave(self.h // self.kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, self.h * hd))


class MLP(nn.Module):
    """GELU MLP or SwiGLU MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        f = cfg.ffn_dim // cfg.tp
        self.swiglu = cfg.mlp == "swiglu"
        self.up = nn.Linear(cfg.dim, f * (2 if self.swiglu else 1), bias=cfg.bias)
        self.down = nn.Linear(f, cfg.dim, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.swiglu:
            g, u = h.chunk(2, dim=-1)
            return self.down(F.silu(g) * u)
        return self.down(F.gelu(h))


class MoE(nn.Module):
    """Top-k routed mixture of :class:`MLP` experts; per-expert batch sizes vary."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg) for _ in range(cfg.n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, chosen = torch.topk(F.softmax(self.router(x), dim=-1), self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = _balanced_route(x, e, len(self.experts), self.top_k) if _is_fake(x) else \
                torch.nonzero(chosen == e, as_tuple=True)
            if tok.numel():
                y = expert(x[tok]) * weights[tok, slot, None]
                out = out.index_add(0, tok, y.to(out.dtype))
        return out.view(shape)


def _is_fake(x: torch.Tensor) -> bool:
    """Shape-only tensor (FakeTensorMode or meta): data-dependent routing is impossible."""
    from torch._subclasses.fake_tensor import is_fake

    return x.is_meta or is_fake(x)


def _balanced_route(x: torch.Tensor, e: int, n_experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token and slot indices of expert ``e`` under perfectly balanced routing (fake capture)."""
    total = x.shape[0] * top_k
    count = total // n_experts + (1 if e < total % n_experts else 0)
    idx = torch.arange(count, device=x.device)
    return idx % x.shape[0], idx % top_k


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.norm1, self.norm2 = _norm(cfg), _norm(cfg)
        self.attn = Attention(cfg)
        self.mlp = MoE(cfg) if cfg.n_experts else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Decoder-only LM; ``forward(idx, targets)`` returns the mean cross-entropy loss.

    ``recompute = True`` wraps each block in non-reentrant activation checkpointing.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg.local()
        self.recompute = False
        self.tok_emb = nn.Embedding(cfg.vocab // cfg.tp, cfg.dim)
        self.pos_emb = None if cfg.rope else nn.Embedding(cfg.max_seq, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm_f = _norm(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab // cfg.tp, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for layer in self.layers:
            if self.recompute and torch.is_grad_enabled():
                x = checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        logits = self.lm_head(self.norm_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten() % logits.shape[-1])


# Flavours: name -> config overrides on top of GPTConfig's defaults.
FLAVOURS: dict[str, dict[str, Any]] = {
    "gpt": {},
    "llama": dict(norm="rmsnorm", mlp="swiglu", rope=True, bias=False, n_kv_heads=2),
    "moe": dict(norm="rmsnorm", mlp="swiglu", rope=True, bias=False, n_experts=4, top_k=2, ffn=128),
}

# Published layer shapes (Llama-2 family); fake capture only.
SHAPES: dict[str, dict[str, Any]] = {
    "7b": dict(dim=4096, n_layers=32, n_heads=32, ffn=11008, vocab=32000, max_seq=4096),
    "13b": dict(dim=5120, n_layers=40, n_heads=40, ffn=13824, vocab=32000, max_seq=4096),
    "70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn=28672, vocab=32000, max_seq=4096),
}


def make_config(flavour: str, shape: str | None = None, **overrides: Any) -> GPTConfig:
    """Config of a flavour (``gpt``/``llama``/``moe``), optionally at a published ``shape``."""
    if flavour not in FLAVOURS:
        raise ValueError(f"unknown model flavour {flavour!r}; known: {', '.join(FLAVOURS)}")
    cfg = replace(GPTConfig(), **FLAVOURS[flavour])
    if shape is not None:
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
        cfg = replace(cfg, **{"n_kv_heads": None, **SHAPES[shape]})
        if flavour == "moe":
            cfg = replace(cfg, n_experts=8, top_k=2)  # Mixtral-style 8 experts, top-2
    return replace(cfg, **{k: v for k, v in overrides.items() if v is not None}).local()
