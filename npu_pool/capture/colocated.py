"""A colocated-RL trace (verl, MindSpeed-RL): the trainer and the rollout engine on one device.

:func:`colocated_capture` makes ``cycles`` iterations of

    resume rollout tags -> rollout (prefill, decode: KV cache + temporaries) -> pause rollout tags
    -> resume "train" -> one training step -> pause "train"

The training step is captured on fake tensors (:func:`npu_pool.capture.fake_capture`, two steps:
the first creates the optimizer states, the second is the step every cycle repeats, with fresh
ids); every allocation of the trainer is made inside region ``train`` (tag 0). The rollout side
is modelled on vLLM, not captured: the rollout weights (bf16, one tensor per projection, tag 1,
``rollout_weights``, paused with a backup as vLLM's sleep level 1 offloads them) and the KV
cache (one tensor per layer, tag 2, ``kv_cache``, paused without backup: sleep discards it) are
made once; each decode step makes the layer temporaries of a batch that shrinks as sequences
finish (untagged: the engine's own activations), sizes changing from step to step.

Replayed through ``npu_pool`` the tags are paused and resumed; through the other policies a
pause is what their users do instead (explicit offload): free the tag's tensors (contents to
host) and empty the cache, then allocate them again at resume.
"""
from __future__ import annotations

from collections import defaultdict, deque
from typing import Any, Callable

from ..trace.format import (CAT_ACTIVATION, CAT_PARAMETER, CAT_TEMPORARY, MARK_ITER_BEGIN, MARK_ITER_END, OP_ALLOC,
                            OP_FREE, OP_MARK, OP_PAUSE, OP_REGION, OP_RESUME, Trace)

__all__ = ["colocated_capture", "TAGS", "cycle_bounds", "resident"]

TAGS = {"train": 0, "rollout_weights": 1, "kv_cache": 2}
_ROLLOUT_TAGS = (("rollout_weights", 1), ("kv_cache", 0))  # (tag, backup)


class _Builder:
    """Appends events with fresh ids and remembers each id's size (frees copy it)."""

    def __init__(self, sites: list[str], full: Callable[[int], None]) -> None:
        self.t = Trace()
        self.size: list[int] = []
        self.sites = sites
        self.full = full  # raises once the trace holds more events than a capture may

    def alloc(self, size: int, cat: int = CAT_TEMPORARY, site: int = -1) -> int:
        self.full(len(self.t))
        i = len(self.size)
        self.size.append(size)
        self.t.append(OP_ALLOC, id=i, size=size, cat=cat, site=site)
        return i

    def free(self, i: int, cat: int = CAT_TEMPORARY, site: int = -1) -> None:
        self.t.append(OP_FREE, id=i, size=self.size[i], cat=cat, site=site)

    def op(self, op: int, tag: int = -1, cat: int = 0) -> None:
        self.t.append(op, id=tag, cat=cat)


def _split_step(trace: Trace) -> tuple[int, int]:
    """[begin, end) of the second iteration of a two-step capture (its ITER markers included)."""
    begins = [i for i, (op, cat) in enumerate(zip(trace.op, trace.cat)) if op == OP_MARK and cat == MARK_ITER_BEGIN]
    ends = [i for i, (op, cat) in enumerate(zip(trace.op, trace.cat)) if op == OP_MARK and cat == MARK_ITER_END]
    if len(begins) < 2 or len(ends) < 2:
        raise ValueError("the training capture needs two iterations with their markers")
    return begins[1], ends[1] + 1


def _copy_events(b: _Builder, trace: Trace, lo: int, hi: int, ids: dict[int, int], carry: dict[int, deque],
                 step: int) -> None:
    """Copy trace events [lo, hi) with fresh ids; a free of an id from before the range frees the
    tensor of that size the previous copy left live (its gradient, its state), FIFO per size."""
    for k in range(lo, hi):
        op, cat, site, iid, size = trace.op[k], trace.cat[k], trace.site[k], trace.id[k], trace.size[k]
        if op == OP_MARK:
            b.t.append(OP_MARK, cat=cat, id=step if cat in (MARK_ITER_BEGIN, MARK_ITER_END) else iid)
        elif op == OP_ALLOC:
            ids[iid] = b.alloc(size, cat, site)
        elif op == OP_FREE:
            if iid in ids:
                b.free(ids.pop(iid), cat, site)
            elif carry[size]:
                b.free(carry[size].popleft(), cat, site)


def _rollout(b: _Builder, cfg: Any, batch: int, prompt: int, response: int, steps: int) -> None:
    """Prefill and `steps` decode steps of a batch that shrinks linearly as sequences finish."""
    d, f, v = cfg.dim, cfg.ffn_dim // cfg.tp, cfg.vocab // cfg.tp
    q = cfg.n_heads // cfg.tp * cfg.head_dim
    kv = max(1, cfg.kv_heads // cfg.tp) * cfg.head_dim

    def layer_pass(tokens: int) -> None:
        x = b.alloc(2 * tokens * d)
        for size in (2 * tokens * (q + 2 * kv), 2 * tokens * q, 2 * tokens * 2 * f, 2 * tokens * f):
            t = b.alloc(size)
            b.free(t)
        y = b.alloc(2 * tokens * d)  # the residual stream moves on before x dies
        b.free(x)
        b.free(y)

    for step in range(steps + 1):
        tokens = batch * prompt if step == 0 else max(1, batch - (batch - 1) * step // steps)
        for _ in range(cfg.n_layers):
            layer_pass(tokens)
        logits = b.alloc(4 * min(tokens, batch) * v)
        probs = b.alloc(4 * min(tokens, batch) * v)
        b.free(logits)
        b.free(probs)


def colocated_capture(cycles: int = 12, model: str = "llama", shape: str = "7b", *, tp: int = 8, seq: int = 2048,
                      batch: int = 1, rollout_batch: int = 64, prompt: int = 512, response: int = 1024,
                      decode_steps: int = 32, layers: int | None = None, progress: bool = False) -> Trace:
    """The trace of ``cycles`` colocated-RL iterations at ``model``/``shape`` on one rank of ``tp``
    (see the module's docstring; ``layers`` overrides the shape's depth); no real memory is used."""
    from ..workloads import make_config, param_count
    from .fake import check_events, events_full, fake_capture

    if cycles < 1 or rollout_batch < 1 or prompt < 1 or response < 1 or decode_steps < 1:
        raise ValueError("cycles, rollout_batch, prompt, response and decode_steps must be >= 1")
    cfg = make_config(model, shape, tp=tp, **({"n_layers": layers} if layers else {}))
    check_events(cycles * cfg.n_layers * (20 * decode_steps + 60),  # 774 a layer and cycle at 32 steps, measured
                 f"{cycles} colocated cycles of {cfg.n_layers} layers")
    train = fake_capture(model, shape, steps=2, batch=batch, seq=seq, tp=tp, mixed_precision="bf16",
                         layers=layers, progress=progress)
    lo, hi = _split_step(train)
    b = _Builder(list(train.meta.get("sites", [])), events_full)
    # set-up: the trainer (its first step creates the optimizer states), then the rollout engine
    b.op(OP_REGION, TAGS["train"])
    ids: dict[int, int] = {}
    carry: dict[int, deque] = defaultdict(deque)
    _copy_events(b, train, 0, lo, ids, carry, 0)
    first = dict(ids)  # live after the first step: weights, states, and what the second step frees
    b.op(OP_REGION, -1)
    b.op(OP_PAUSE, TAGS["train"], 1)
    n_weights = 0
    b.op(OP_REGION, TAGS["rollout_weights"])
    emb = 2 * cfg.vocab // tp * cfg.dim
    layer = 2 * (param_count(cfg) - emb) // cfg.n_layers  # bf16 bytes of one layer (emb: both vocab matrices' params)
    b.alloc(emb, CAT_PARAMETER)
    for _ in range(cfg.n_layers):
        for share in (0.24, 0.08, 0.45, 0.23):  # qkv, o, gate_up, down
            b.alloc(max(512, int(layer * share)), CAT_PARAMETER)
            n_weights += 1
    b.alloc(emb, CAT_PARAMETER)
    b.op(OP_REGION, TAGS["kv_cache"])
    kv_token = 2 * 2 * max(1, cfg.kv_heads // tp) * cfg.head_dim  # K and V, bf16, per layer
    for _ in range(cfg.n_layers):
        b.alloc(kv_token * rollout_batch * (prompt + response), CAT_ACTIVATION)
    b.op(OP_REGION, -1)
    for name, backup in _ROLLOUT_TAGS:
        b.op(OP_PAUSE, TAGS[name], backup)
    # frees in the repeated step of tensors from before it: FIFO per size, as the step re-creates them
    step_allocs = {train.id[k] for k in range(lo, hi) if train.op[k] == OP_ALLOC}
    external = [train.id[k] for k in range(lo, hi) if train.op[k] == OP_FREE and train.id[k] not in step_allocs]
    orig_size = {i: size for op, i, size in zip(train.op, train.id, train.size) if op == OP_ALLOC}
    for i in external:
        if i in first:
            carry[orig_size[i]].append(first.pop(i))
    ids.clear()
    for c in range(cycles):
        for name, _ in _ROLLOUT_TAGS:
            b.op(OP_RESUME, TAGS[name])
        _rollout(b, cfg, rollout_batch, prompt, response, decode_steps)
        for name, backup in _ROLLOUT_TAGS:
            b.op(OP_PAUSE, TAGS[name], backup)
        b.op(OP_RESUME, TAGS["train"])
        b.op(OP_REGION, TAGS["train"])
        step_ids: dict[int, int] = {}
        _copy_events(b, train, lo, hi, step_ids, carry, c + 1)
        for orig, new in step_ids.items():  # what this step leaves live, the next one frees
            carry[orig_size[orig]].append(new)
        b.op(OP_REGION, -1)
        b.op(OP_PAUSE, TAGS["train"], 1)
    t = b.t
    t.meta = {"sites": b.sites, "n_ids": len(b.size), "origin": f"npu_pool.colocated_capture:{model}-{shape}",
              "device": 0, "capture": {**train.meta.get("capture", {}), "colocated": True, "cycles": cycles,
                                       "rollout_batch": rollout_batch, "prompt": prompt, "response": response,
                                       "decode_steps": decode_steps, "tags": TAGS},
              "setup": "fake training step, modelled rollout", "expandable_segments": False}
    t.validate("colocated trace")
    return t


def cycle_bounds(trace: Trace) -> list[tuple[int, int]]:
    """[begin, end) of each cycle of a colocated trace: from a resume of the rollout weights to
    the next one (the last runs to the end)."""
    starts = [k for k, (op, i) in enumerate(zip(trace.op, trace.id)) if op == OP_RESUME and i == TAGS["rollout_weights"]]
    return [(s, e) for s, e in zip(starts, starts[1:] + [len(trace)])]


def resident(trace: Trace) -> Trace:
    """The same program with nothing paused or offloaded: every tensor stays on the device."""
    t = Trace(meta=dict(trace.meta))
    for ev in trace.events():
        if ev.op not in (OP_PAUSE, OP_RESUME):
            t.append(ev.op, id=ev.id, size=ev.size, stream=ev.stream, site=ev.site, cat=ev.cat, addr=ev.addr)
    return t
