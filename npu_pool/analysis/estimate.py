"""Static memory estimate of transformer training from a model config, per rank.

Parameters come from the shapes (hidden size, layers, heads, KV heads, FFN size,
vocabulary, experts), sliced as Megatron slices them: tensor parallelism (TP)
divides the attention heads, the FFN and the vocabulary; pipeline parallelism (PP)
gives each stage ``layers / pp`` layers (a whole number, as Megatron requires; embeddings
on the first stage, the output head on the last); expert parallelism (EP) divides the experts.

Bytes per parameter (ZeRO, Rajbhandari et al. 2020): weights in the training dtype,
gradients too but for bf16 weights, whose gradients Megatron accumulates and all-reduces
in fp32 (``accumulate_allreduce_grads_in_fp32``, forced for bf16: 2 + 4 + 12 bytes, as
Megatron's own theoretical estimate counts); Adam keeps two fp32 states, plus an fp32
master copy under mixed precision (12 bytes per parameter); SGD with momentum one state
(+ master). ZeRO stage 1 (Megatron's distributed optimizer) shards optimizer states over
the data-parallel group, stage 2 also the gradients, stage 3 also the weights; experts'
parameters over the expert data-parallel group (dp / ep: expert parallelism is carved out
of data parallelism).

Activations per layer and micro-batch follow Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models" (arXiv:2205.05198):
``s*b*h*(34 + 5*a*s/h)`` bytes for 16-bit activations, ``s*b*h*(10 + 24/t +
5*a*s/(h*t))`` with TP ``t``, ``s*b*h/t*(34 + 5*a*s/h)`` with TP and sequence
parallelism; selective recompute drops the ``5*a*s/h`` term, full recompute keeps
only each layer's input (``2*s*b*h``) plus one layer's working set while it is
recomputed. The terms are generalised for a FFN size other than ``4h`` (``3sbh +
4sbf``, gated MLPs ``3sbh + 6sbf``), grouped-query attention, no dropout,
flash attention (no ``s*s`` terms, a fp32 log-sum-exp per row instead), other
activation dtypes and MoE (top-k copies of the MLP activations). With the 1F1B
pipeline schedule stage ``k`` holds ``min(pp - k, micro-batches)`` micro-batches
in flight; the last stage adds the output layer (``4*s*b*h`` -- ``/t`` with sequence parallelism -- ``+ 4*s*b*v/t``).

Not estimated: temporaries (kernel workspaces, communication buffers), allocator
rounding and fragmentation -- compare with a trace to see those.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable

from ..config import ConfigError, load_yaml, show

__all__ = ["ModelConfig", "Estimate", "StageEstimate", "estimate", "load_config", "config_from_dict",
           "config_from_trace", "compare", "ComparisonRow", "DTYPE_BYTES", "ALIASES"]

DTYPE_BYTES = {"fp32": 4, "float32": 4, "tf32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1}
OPTIMIZERS = ("adam", "adamw", "sgd", "none")
RECOMPUTE = ("none", "selective", "full")

# Config keys as Megatron / Hugging Face spell them -> ModelConfig fields.
ALIASES = {"hidden_size": "hidden", "n_embd": "hidden", "dim": "hidden", "num_layers": "layers",
           "num_hidden_layers": "layers", "n_layer": "layers", "n_layers": "layers",
           "num_attention_heads": "heads", "n_head": "heads", "n_heads": "heads",
           "num_query_groups": "kv_heads", "num_key_value_heads": "kv_heads", "n_kv_heads": "kv_heads",
           "ffn_hidden_size": "ffn", "intermediate_size": "ffn", "vocab_size": "vocab", "padded_vocab_size": "vocab",
           "seq_length": "seq", "seq_len": "seq", "max_position_embeddings": "max_positions",
           "micro_batch_size": "micro_batch", "mbs": "micro_batch", "batch": "micro_batch",
           "params_dtype": "dtype", "tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp",
           "expert_model_parallel_size": "ep", "data_parallel_size": "dp", "num_experts": "experts",
           "moe_router_topk": "top_k", "zero_stage": "zero", "recompute_granularity": "recompute",
           "swiglu": "gated_mlp", "untie_embeddings_and_output_weights": "_untie",
           "use_flash_attn": "flash_attention", "num_micro_batches": "micro_batches",
           "gradient_accumulation_steps": "micro_batches", "accumulate_allreduce_grads_in_fp32": "_grads_fp32",
           "make_vocab_size_divisible_by": "vocab_multiple", "bf16": "_bf16", "fp16": "_fp16",
           "use_distributed_optimizer": "_distributed_optimizer", "disable_bias_linear": "_no_bias",
           "normalization": "_normalization", "position_embedding_type": "_position_type",
           "attention_dropout": "_dropout", "hidden_dropout": "_dropout"}
# Megatron training settings with no effect on this model's memory figures: read and set aside (the
# estimate names them), never refused as unknown
IGNORED = frozenset({"global_batch_size", "recompute_method", "recompute_num_layers", "train_iters", "lr",
                     "min_lr", "weight_decay", "clip_grad", "seed", "init_method_std", "lr_decay_style",
                     "lr_warmup_iters", "adam_beta1", "adam_beta2", "adam_eps", "log_interval", "eval_interval",
                     "eval_iters", "save_interval", "tokenizer_type", "rotary_base", "norm_epsilon",
                     "layernorm_epsilon", "attention_softmax_in_fp32", "masked_softmax_fusion",
                     "bias_gelu_fusion", "bias_dropout_fusion", "no_masked_softmax_fusion", "no_bias_gelu_fusion",
                     "no_bias_dropout_fusion", "untie_embeddings_and_output_weights_for_rope"})


@dataclass
class ModelConfig:
    """A decoder-only transformer and how it is trained (see module docstring for the model)."""

    hidden: int
    layers: int
    heads: int
    vocab: int
    ffn: int | None = None  # None: 4*hidden, or 8/3*hidden rounded up to 64 for gated MLPs
    kv_heads: int | None = None  # None: heads (multi-head attention)
    seq: int = 2048
    micro_batch: int = 1
    micro_batches: int | None = None  # per step and pipeline; None: pp (enough to fill the pipeline)
    dtype: str = "bf16"  # weights (and gradients, see grad_dtype)
    grad_dtype: str | None = None  # gradients; None: fp32 for bf16 weights under mixed precision (Megatron's), else dtype
    act_dtype: str | None = None  # activations; None: dtype
    mixed_precision: bool | None = None  # fp32 master weights; None: dtype is not fp32
    optimizer: str = "adam"
    zero: int = 0
    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    experts: int = 0
    top_k: int = 2
    recompute: str = "none"
    sequence_parallel: bool = False
    flash_attention: bool = False
    dropout: bool = True
    gated_mlp: bool = False
    bias: bool = True
    norm: str = "layernorm"  # or rmsnorm
    position: str = "learned"  # or rope
    max_positions: int | None = None  # learned position table; None: seq
    tied_embeddings: bool = False
    vocab_multiple: int = 1  # the vocabulary is padded to a multiple of this times tp (Megatron's default: 128)

    def checked(self) -> "ModelConfig":
        """Normalise spellings and check types and ranges; raise ValueError naming the field
        (values are shown cut short)."""
        c = self
        for name in _STR_FIELDS:
            v = getattr(c, name)
            if v is not None and not isinstance(v, (str, bool)):
                raise ValueError(f"{name} must be a word, not {show(v)}")
        if isinstance(c.recompute, bool) or c.recompute in ("on", "off", "true", "false", "uniform", "block"):
            c = replace(c, recompute="full" if c.recompute in (True, "on", "true", "uniform", "block") else "none")
        if c.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, not {show(c.optimizer)}")
        if c.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)} (or on/off), not {show(c.recompute)}")
        for name in ("dtype", "act_dtype", "grad_dtype"):
            v = getattr(c, name)
            if v is not None and (not isinstance(v, str) or v not in DTYPE_BYTES):
                raise ValueError(f"{name} must be one of {', '.join(DTYPE_BYTES)}, not {show(v)}")
        for name in _BOOL_FIELDS:
            v = getattr(c, name)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"{name} must be true or false, not {show(v)}")
        positive = ("hidden", "layers", "heads", "vocab", "seq", "micro_batch", "dp", "tp", "pp", "ep", "vocab_multiple")
        defaulted = ("ffn", "kv_heads", "micro_batches", "max_positions")  # left out: the default
        for name in _INT_FIELDS:
            v = getattr(c, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < _INT_MAX):
                lo = 1 if name in positive or name in defaulted else 0  # (what the checks below say of 0 too)
                raise ValueError(f"{name} must be a whole number in {lo}..{_INT_MAX - 1}"
                                 f"{', or left out for its default' if name in defaulted else ''}, not {show(v)}")
        if c.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero must be 0, 1, 2 or 3, not {show(c.zero)}")
        for name, allowed in (("norm", ("layernorm", "rmsnorm")), ("position", ("learned", "rope"))):
            if getattr(c, name) not in allowed:
                raise ValueError(f"{name} must be {' or '.join(allowed)}, not {show(getattr(c, name))}")
        for name in positive:
            v = getattr(c, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a whole number in 1..{_INT_MAX - 1}, not {show(v)}")
        for name in defaulted:
            if getattr(c, name) == 0:
                raise ValueError(f"{name} must be a whole number in 1..{_INT_MAX - 1}, or left out for its default, "
                                 "not 0")
        if c.hidden % c.heads:
            raise ValueError(f"hidden={c.hidden} is not divisible by heads={c.heads}")
        if c.heads % c.tp or (c.kv_heads or c.heads) % c.tp:
            raise ValueError(f"heads={c.heads} (kv {c.kv_heads or c.heads}) not divisible by tp={c.tp}")
        if c.ffn_size % c.tp:
            raise ValueError(f"ffn={c.ffn_size} not divisible by tp={c.tp}: tensor parallelism splits the MLP's "
                             "hidden size evenly over the ranks")
        if c.experts and c.experts % c.ep:
            raise ValueError(f"experts={c.experts} not divisible by ep={c.ep}")
        if c.kv_heads and not (c.kv_heads <= c.heads and c.heads % c.kv_heads == 0):
            raise ValueError(f"kv_heads={c.kv_heads} must divide heads={c.heads} (grouped-query attention)")
        if c.experts and not 1 <= c.top_k <= c.experts:
            raise ValueError(f"top_k={c.top_k} must be in 1..experts={c.experts}"
                             f"{' (2 unless given: give top_k too)' if c.top_k == 2 else ''}")
        if c.ep > 1 and not c.experts:
            raise ValueError(f"ep={c.ep} divides the experts of a mixture-of-experts model: give experts too")
        if c.dp % c.ep:
            raise ValueError(f"ep={c.ep} does not divide dp={c.dp}: expert parallelism is carved out of the "
                             "data-parallel group (its ranks hold different experts of the same layers): give dp, "
                             "a multiple of ep")
        if c.position == "learned" and c.max_positions is not None and c.seq > c.max_positions:
            raise ValueError(f"seq={c.seq} passes max_positions={c.max_positions}: a learned position table has "
                             "a row per position (give a longer table, or position rope)")
        if c.pp > c.layers:
            raise ValueError(f"pp={c.pp} stages for {c.layers} layers: a stage would hold none")
        if c.layers % c.pp:  # (ceil per stage left the last stages empty: 9 layers over 8 stages)
            raise ValueError(f"layers={c.layers} not divisible by pp={c.pp}: Megatron gives every pipeline stage "
                             "the same number of layers")
        return c

    @property
    def ffn_size(self) -> int:
        if self.ffn:
            return self.ffn
        return 64 * math.ceil(8 * self.hidden / 3 / 64) if self.gated_mlp else 4 * self.hidden

    @property
    def grad_bytes(self) -> int:
        """Bytes per gradient: grad_dtype's; by default fp32 for bf16 weights under mixed precision
        (Megatron accumulates and all-reduces them in fp32), else the weights' dtype."""
        if self.grad_dtype is not None:
            return DTYPE_BYTES[self.grad_dtype]
        return 4 if self.dtype in ("bf16", "bfloat16") and self.master_weights else DTYPE_BYTES[self.dtype]

    @property
    def master_weights(self) -> bool:
        """Whether the optimizer keeps an fp32 master copy (none without an optimizer)."""
        if self.optimizer == "none":
            return False
        return self.mixed_precision if self.mixed_precision is not None else DTYPE_BYTES[self.dtype] < 4


@dataclass
class StageEstimate:
    """Bytes on one rank of pipeline stage ``stage``."""

    stage: int
    layers: int
    params: int
    weights: int
    gradients: int
    optimizer_states: int
    activations: int
    in_flight: int  # micro-batches whose activations the stage holds at once

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer_states + self.activations


@dataclass
class Estimate:
    """The estimate for the heaviest stage, with every stage and the per-layer activation figure."""

    config: ModelConfig
    stage: StageEstimate
    stages: list[StageEstimate]
    total_params: int  # whole model, all ranks
    activation_per_layer: int  # one layer, one micro-batch, this rank
    formula: str = field(default="")

    def as_dict(self) -> dict[str, Any]:
        s = self.stage
        return dict(config=asdict(self.config), stage=s.stage, layers=s.layers, params_per_rank=s.params,
                    total_params=self.total_params, weights_bytes=s.weights, gradients_bytes=s.gradients,
                    optimizer_states_bytes=s.optimizer_states, activations_bytes=s.activations,
                    total_bytes=s.total, micro_batches_in_flight=s.in_flight,
                    activation_per_layer_bytes=self.activation_per_layer, formula=self.formula,
                    stages=[dict(asdict(x), total=x.total) for x in self.stages])


# -- parameters --------------------------------------------------------------------------
def _layer_params(c: ModelConfig) -> int:
    """One transformer layer on one TP rank (experts: on one EP rank)."""
    t, h = c.tp, c.hidden
    hd = h // c.heads
    b = 1 if c.bias else 0
    q, kv = c.heads // t * hd, (c.kv_heads or c.heads) // t * hd
    norm = h * (2 if c.norm == "layernorm" and c.bias else 1)
    attn = h * (q + 2 * kv) + b * (q + 2 * kv) + q * h + b * h
    if c.experts:
        mlp = _expert_params(c) + h * c.experts  # local experts + router
    else:
        mlp = _mlp_params(c)
    return 2 * norm + attn + mlp


def _mlp_params(c: ModelConfig) -> int:
    """One MLP (one expert's) on one TP rank."""
    h, f, b = c.hidden, c.ffn_size // c.tp, 1 if c.bias else 0
    n_in = 2 if c.gated_mlp else 1
    return h * f * n_in + b * f * n_in + f * h + b * h


def _expert_params(c: ModelConfig) -> int:
    """The local experts of one layer on one TP and EP rank (0 without experts): sharded by ZeRO
    over the expert data-parallel group."""
    return _mlp_params(c) * (c.experts // c.ep) if c.experts else 0


def _stage_params(c: ModelConfig, stage: int) -> tuple[int, int]:
    """(layers, parameters) on one rank of ``stage``."""
    per = math.ceil(c.layers / c.pp)
    layers = max(0, min(per, c.layers - stage * per))
    n = layers * _layer_params(c)
    h, v = c.hidden, _vocab_rows(c)
    if stage == 0:
        n += v * h + (h * (c.max_positions or c.seq) if c.position == "learned" else 0)
    if stage == c.pp - 1:
        n += h * (2 if c.norm == "layernorm" and c.bias else 1)  # final norm
        if not (c.tied_embeddings and c.pp == 1):
            n += v * h  # output head (a tied head on another stage still needs its copy)
    return layers, n


def _vocab_rows(c: ModelConfig) -> int:
    """Vocabulary rows on one tensor-parallel rank: Megatron pads the vocabulary to a multiple of
    make_vocab_size_divisible_by x tp, so that every rank holds as many (a vocabulary smaller
    than tp still gives each rank a row)."""
    unit = c.vocab_multiple * c.tp
    return -(-c.vocab // unit) * unit // c.tp


def _total_params(c: ModelConfig) -> int:
    one = replace(c, tp=1, pp=1, ep=1)
    return _stage_params(one, 0)[1]


# -- activations --------------------------------------------------------------------------
def _layer_activations(c: ModelConfig, recompute: str | None = None) -> int:
    """Activation bytes one layer keeps for backward, per micro-batch, on one rank."""
    recompute = c.recompute if recompute is None else recompute
    s, b, h, a, t = c.seq, c.micro_batch, c.hidden, c.heads, c.tp
    e = DTYPE_BYTES[c.act_dtype or c.dtype] / 2  # the formula counts 2-byte elements
    sp = t if c.sequence_parallel else 1
    if recompute == "full":
        return int(e * 2 * s * b * h / sp)
    kvd = (c.kv_heads or c.heads) * (h // a)
    f = c.ffn_size
    k = c.top_k if c.experts else 1
    mask = s * b * h if c.dropout else 0
    # outside the TP regions: both norm inputs, the QKV input, the MLP input(s), two dropout masks
    replicated = e * (2 * s * b * h * 3 + 2 * s * b * h * k) + mask * (1 + k)
    mlp_inner = (6 if c.gated_mlp else 4) * s * b * f * k
    sharded = e * (2 * s * b * h + 4 * s * b * kvd + 2 * s * b * h + mlp_inner)
    if recompute != "selective":
        if c.flash_attention:
            sharded += 4 * a * s * b  # fp32 log-sum-exp per query row
        else:
            scores = a * s * s * b
            sharded += e * 2 * scores + (scores + e * 2 * scores if c.dropout else 0)
    return int(replicated / sp + sharded / t)


def _output_activations(c: ModelConfig) -> int:
    """Final norm, output layer input and fp32 logits for the loss (last stage, one micro-batch)."""
    s, b, h, t = c.seq, c.micro_batch, c.hidden, c.tp
    e = DTYPE_BYTES[c.act_dtype or c.dtype] / 2
    sp = t if c.sequence_parallel else 1
    return int(e * 4 * s * b * h / sp + 4 * s * b * _vocab_rows(c))


def _formula(c: ModelConfig) -> str:
    """The textbook form of what _layer_activations computes for ``c`` (2-byte activations)."""
    if c.recompute == "full":
        return "2*s*b*h per layer (full recompute: the layer input only)"
    sp = "/t" if c.sequence_parallel else ""
    if c.recompute == "selective":
        return f"s*b*h*(10{sp}+24/t) per layer (selective recompute: attention scores recomputed)"
    if c.flash_attention:
        return f"s*b*h*(10{sp}+24/t) + 4*a*s*b/t per layer (flash attention: scores never stored)"
    return f"s*b*h*(10{sp}+24/t+5*a*s/(h*t)) per layer" if c.tp > 1 or c.sequence_parallel else \
        "s*b*h*(34+5*a*s/h) per layer"


def _generalised(c: ModelConfig) -> str:
    """What the figure beside the formula differs from the textbook's model in (its 2-byte
    activations, dropout, a 4h MLP, multi-head attention, no experts), then the settings."""
    what = [f"{'a gated ' if c.gated_mlp else 'an '}MLP of {c.ffn_size}" if c.gated_mlp or c.ffn_size != 4 * c.hidden
            else "", f"{c.kv_heads} KV heads" if c.kv_heads and c.kv_heads != c.heads else "",
            f"{c.experts} experts, top {c.top_k}" if c.experts else "", "" if c.dropout else "no dropout",
            f"{DTYPE_BYTES[c.act_dtype or c.dtype]}-byte activations" if DTYPE_BYTES[c.act_dtype or c.dtype] != 2
            else ""]
    return ", ".join([w for w in what if w] + [f"recompute={c.recompute}, tp={c.tp}, sp={c.sequence_parallel}, "
                                                 f"flash={c.flash_attention}"])


def estimate(config: ModelConfig) -> Estimate:
    """Weights, gradients, optimizer states and activations per rank, for every pipeline stage."""
    c = config.checked()
    wb = DTYPE_BYTES[c.dtype]
    per_param_opt = {"adam": 8, "adamw": 8, "sgd": 4, "none": 0}[c.optimizer] + (4 if c.master_weights else 0)
    m = c.micro_batches or c.pp
    per_layer = _layer_activations(c)
    extra = _layer_activations(c, "none") if c.recompute == "full" else 0  # one layer recomputed in backward
    stages = []
    for k in range(c.pp):
        layers, n = _stage_params(c, k)
        in_flight = max(1, min(c.pp - k, m))
        acts = in_flight * layers * per_layer + (extra if layers else 0)
        if k == c.pp - 1:
            acts += _output_activations(c)
        experts = layers * _expert_params(c)  # (sharded over the expert data-parallel group, dp / ep)

        def sharded(per_param: int, stage: int) -> int:
            if c.zero < stage:
                return n * per_param
            return (n - experts) * per_param // c.dp + experts * per_param // (c.dp // c.ep)

        stages.append(StageEstimate(stage=k, layers=layers, params=n, weights=sharded(wb, 3),
                                    gradients=sharded(c.grad_bytes, 2), optimizer_states=sharded(per_param_opt, 1),
                                    activations=acts, in_flight=in_flight))
    worst = max(stages, key=lambda x: x.total)
    formula = _formula(c) + f"; generalised (Korthikanti et al. 2022) for {_generalised(c)}"
    return Estimate(c, worst, stages, _total_params(c), per_layer, formula)


# -- configs --------------------------------------------------------------------------------
_FIELDS = {f.name for f in fields(ModelConfig)}
_STR_FIELDS = ("dtype", "act_dtype", "grad_dtype", "optimizer", "recompute", "norm", "position")
_BOOL_FIELDS = ("mixed_precision", "sequence_parallel", "flash_attention", "dropout", "gated_mlp", "bias",
                "tied_embeddings")
_INT_FIELDS = ("hidden", "layers", "heads", "vocab", "ffn", "kv_heads", "seq", "micro_batch", "micro_batches",
               "zero", "dp", "tp", "pp", "ep", "experts", "top_k", "max_positions", "vocab_multiple")
_INT_MAX = 1 << 40  # no model dimension or parallel size comes near it
# Megatron's settings that give another field, or spell its values otherwise (ALIASES' "_" names):
# (field, its value, whether the setting is true/false)
_DERIVED: dict[str, tuple[str, Callable[[Any], Any], bool]] = {
    "_untie": ("tied_embeddings", lambda v: not v, True),
    # (false: the weights' dtype, which the default is but for bf16, where Megatron forces it true)
    "_grads_fp32": ("grad_dtype", lambda v: "fp32" if v else None, True),
    "_bf16": ("dtype", lambda v: "bf16" if v else None, True),  # (false: say nothing; fp32 is `params_dtype`'s)
    "_fp16": ("dtype", lambda v: "fp16" if v else None, True),
    "_distributed_optimizer": ("zero", lambda v: 1 if v else None, True),  # (the optimizer states sharded: ZeRO-1)
    "_no_bias": ("bias", lambda v: not v, True),
    "_normalization": ("norm", lambda v: v.lower() if isinstance(v, str) else v, False),  # LayerNorm, RMSNorm
    "_position_type": ("position", lambda v: "learned" if v == "learned_absolute" else v, False),
    "_dropout": ("dropout", lambda v: v > 0 if isinstance(v, (int, float)) and not isinstance(v, bool) else v, False),
}


_SAME_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _differ(a: Any, b: Any) -> bool:
    """Whether two values given for one field disagree (1 and 1.0 do; "bf16" and "bfloat16" do not)."""
    if isinstance(a, str) and isinstance(b, str):
        return _SAME_DTYPE.get(a, a) != _SAME_DTYPE.get(b, b)
    return a != b or type(a) is not type(b)


def config_from_dict(d: dict[str, Any], ignored: list[str] | None = None) -> ModelConfig:
    """A ModelConfig from a dict with field names or their Megatron / Hugging Face aliases;
    Megatron's settings with no effect on memory (IGNORED) are set aside, into ``ignored``."""
    if "architectures" in d or "model_type" in d:  # a whole config.json: no field says the layers' details
        kind = d.get("model_type", d.get("architectures"))
        raise ValueError(f"this is a Hugging Face config.json (model {show(kind)}): its size keys (hidden_size, "
                         "num_hidden_layers, num_attention_heads, intermediate_size, vocab_size, ...) are read, but "
                         "what its architecture implies is not: copy them into a config of their own with gated_mlp, "
                         "norm, position, bias and tied_embeddings as the model has them (docs/analysis.md)")
    out: dict[str, Any] = {}
    given_by: dict[str, tuple[str, Any]] = {}  # field -> the key that set it, as written
    for key, value in d.items():
        if not isinstance(key, str):
            raise ValueError(f"config key {show(key)} is not a name; known: {', '.join(sorted(_FIELDS))}")
        name = key.replace("-", "_")
        if name in IGNORED:
            if ignored is not None:
                ignored.append(key)
            continue
        written, k = value, ALIASES.get(name, name)
        if k in _DERIVED:
            k, to, flag = _DERIVED[k]
            if flag and not isinstance(value, bool):
                raise ValueError(f"{key} must be true or false, not {show(value)}")
            value = to(value)
        if k not in _FIELDS:
            raise ValueError(f"unknown config key {show(key)}; known: {', '.join(sorted(_FIELDS))}")
        if value is None:  # (an argument dump's unset setting: as if absent, the default or another name's)
            continue
        if k in out and _differ(out[k], value):  # two names of one field
            first, was = given_by[k]
            if name != "padded_vocab_size":  # (what the embedding has: it wins over vocab_size, either order)
                if first.replace("-", "_") == "padded_vocab_size":
                    continue
                raise ValueError(f"config keys {show(first)} ({show(was)}) and {show(key)} ({show(written)}) both "
                                 f"give {k}, differently: keep one")
        out[k] = value
        given_by[k] = (key, written)
    missing = [k for k in ("hidden", "layers", "heads", "vocab") if k not in out]
    if missing:
        raise ValueError(f"config lacks {', '.join(missing)}")
    return ModelConfig(**out).checked()


def load_config(path: str | Path, ignored: list[str] | None = None) -> ModelConfig:
    """Read a YAML (or JSON) file of config keys; a ``model:`` section is used when present.
    The file is read by :func:`npu_pool.config.load_yaml` (no aliases, bounded depth, size and
    integers); every problem is a ValueError naming the file. ``ignored``: as config_from_dict's."""
    d = load_yaml(str(path), "")
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: expected a mapping of config keys")
    if isinstance(d.get("model"), dict):
        top = {k: v for k, v in d.items() if k != "model"}
        both = [k for k, v in d["model"].items()  # (null: unset, as config_from_dict reads it; argument dumps have many)
                if top.get(k) is not None and v is not None and _differ(top[k], v)]
        if both:  # (two spellings of one field that disagree are refused too: config_from_dict)
            raise ConfigError(f"{path}: {show(both[0])} is given at the top ({show(top[both[0]])}) and under model: "
                              f"({show(d['model'][both[0]])}), differently: keep one")
        d = {**top, **d["model"]}
    try:
        return config_from_dict(d, ignored)
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None


def config_from_trace(meta: dict[str, Any]) -> ModelConfig | None:
    """The config of a trace made by ``npu-pool capture`` (from ``meta["capture"]``); None for others."""
    cap = meta.get("capture")
    if not isinstance(cap, dict) or "model" not in cap:
        return None
    from ..workloads import MODEL_NAMES, make_config  # imports torch: only here

    if not isinstance(cap["model"], str) or cap["model"] not in MODEL_NAMES:  # e.g. a Hugging Face model
        return None
    try:
        return _capture_config(cap, make_config)
    except (TypeError, KeyError, AttributeError, OverflowError, ZeroDivisionError) as e:  # a trace's meta is input
        raise ValueError(f"the trace's meta['capture'] is malformed ({type(e).__name__}: {str(e)[:80]})") from None


_CAPTURE_INTS = ("layers", "dim", "heads", "vocab", "seq", "batch", "tp")
_CAPTURE_BOOLS = ("recompute", "fake")


def _check_capture(cap: dict[str, Any]) -> None:
    """Each field of the trace's ``meta["capture"]`` of the type ``npu-pool capture`` writes (a
    string "no" read as true made a full recompute, 2.7 an int, "1024" failed naming a field the
    user never gave)."""
    for key in _CAPTURE_INTS:
        v = cap.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError(f"the trace's meta['capture'] is malformed: {key} is {str(v)[:40]!r}, not a whole number")
    for key in _CAPTURE_BOOLS:
        v = cap.get(key)
        if v is not None and not isinstance(v, bool):
            raise ValueError(f"the trace's meta['capture'] is malformed: {key} is {str(v)[:40]!r}, not true or false")
    for key in ("seq", "batch"):
        if not cap.get(key):
            raise ValueError(f"the trace's meta['capture'] is malformed: it has no {key}")


def _capture_config(cap: dict[str, Any], make_config: Any) -> ModelConfig:
    _check_capture(cap)
    max_seq = cap.get("seq")
    if cap.get("fake"):  # (a fake capture's table is the shape's, longer if its sequence is: fake_capture)
        max_seq = max(max_seq, make_config(cap["model"], cap.get("shape")).max_seq)
    over = dict(n_layers=cap.get("layers"), dim=cap.get("dim"), n_heads=cap.get("heads"),
                vocab=cap.get("vocab") if not cap.get("fake") else None, max_seq=max_seq)
    g = make_config(cap["model"], cap.get("shape") if cap.get("fake") else None,
                    **{k: v for k, v in over.items() if v is not None})
    tp = int(cap.get("tp", 1) or 1)
    vocab = g.vocab if cap.get("fake") else int(cap.get("vocab") or g.vocab) * tp
    bf16 = cap.get("mixed_precision") == "bf16"
    return ModelConfig(hidden=g.dim, layers=int(cap.get("layers") or g.n_layers), heads=g.n_heads, vocab=vocab,
                       ffn=g.ffn_dim, kv_heads=g.kv_heads, seq=int(cap["seq"]), micro_batch=int(cap["batch"]),
                       micro_batches=1, dtype="fp32", act_dtype="bf16" if bf16 else "fp32",
                       mixed_precision=False, optimizer="adamw", tp=tp, experts=g.n_experts, top_k=g.top_k,
                       recompute="full" if cap.get("recompute") else "none", flash_attention=True, dropout=False,
                       gated_mlp=g.mlp == "swiglu", bias=g.bias, norm=g.norm,
                       position="rope" if g.rope else "learned", max_positions=g.max_seq).checked()


# -- estimate vs trace ------------------------------------------------------------------------
@dataclass
class ComparisonRow:
    """One figure, estimated and measured; ``measured`` None when the trace cannot tell."""

    figure: str
    estimated: int | None
    measured: int | None

    @property
    def diff(self) -> int | None:
        return None if self.estimated is None or self.measured is None else self.measured - self.estimated

    @property
    def ratio(self) -> float | None:
        return None if not self.estimated or self.measured is None else self.measured / self.estimated

    def as_dict(self) -> dict[str, Any]:
        return dict(figure=self.figure, estimated_bytes=self.estimated, measured_bytes=self.measured,
                    diff_bytes=self.diff, measured_over_estimated=self.ratio)


def compare(est: Estimate, profile: Any) -> list[ComparisonRow]:
    """Estimate vs a :class:`~npu_pool.analysis.breakdown.TraceProfile`.

    Per category the trace's highest live bytes of that category anywhere (the
    estimate is each category's steady high), then temporaries (not estimated) and
    the total: the estimate's sum vs the trace's peak live bytes.
    """
    s = est.stage
    known = profile.category_source != "none"
    g = profile.group_max
    rows = [ComparisonRow(label, value, g[key] if known else None) for label, key, value in (
        ("weights", "weights", s.weights), ("gradients", "gradients", s.gradients),
        ("optimizer states", "optimizer_states", s.optimizer_states), ("activations", "activations", s.activations))]
    rows.append(ComparisonRow("temporaries", None, g["temporaries"] if known else None))
    rows.append(ComparisonRow("peak live (estimated: the sum above)", s.total, profile.peak_live))
    return rows
