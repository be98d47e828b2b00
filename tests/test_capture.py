"""Tests of ``npu-pool capture``: real CPU captures of tiny models and fake large shapes."""
from __future__ import annotations

import importlib.util
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from npu_pool.capture import capture, fake_capture  # noqa: E402
from npu_pool.capture.loop import _progress  # noqa: E402
from npu_pool.capture.profile import (CaptureError, Identity, _Rec, _site, host_scalar,  # noqa: E402
                                      profiler_records, to_trace)
from npu_pool.recorder import repeated_blocks  # noqa: E402
from npu_pool.trace.stats import summarize  # noqa: E402
from npu_pool.workloads import build_model, make_config, param_count  # noqa: E402
from npu_pool.trace.format import (CAT_ACTIVATION, CAT_GRADIENT, CAT_OPTIMIZER_STATE, CAT_PARAMETER,  # noqa: E402
                                   CAT_TEMPORARY, MARK_BACKWARD_BEGIN, MARK_BACKWARD_END, MARK_FORWARD_BEGIN,
                                   MARK_FORWARD_END, MARK_ITER_BEGIN, MARK_ITER_END, MARK_LAYER_ENTER,
                                   MARK_LAYER_EXIT, MARK_OPTIMIZER_BEGIN, MARK_OPTIMIZER_END, MARK_SETUP_BEGIN,
                                   MARK_SETUP_END, OP_ALLOC, OP_FREE, OP_INIT_ALLOC, OP_MARK, Trace)
from conftest import unavailable

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(layers=2, dim=32, heads=2, vocab=128)  # activations dominate parameters at batch 4 x seq 64
LAYERS = TINY["layers"]


@pytest.fixture(scope="module")
def base() -> Trace:
    return capture("gpt", 2, 4, 64, progress=False, **TINY)


@pytest.fixture(scope="module")
def accum_bf16() -> Trace:
    return capture("llama", 2, 2, 32, grad_accum=2, mixed_precision="bf16", progress=False, **TINY)


# -- helpers ----------------------------------------------------------------------------
def _marks(t: Trace) -> list[tuple[int, int, int]]:
    """(event index, mark code, argument) of every marker."""
    return [(i, c, a) for i, (op, c, a) in enumerate(zip(t.op, t.cat, t.id)) if op == OP_MARK]


def _allocs(t: Trace, cat: int | None = None) -> list[tuple[int, int, int]]:
    """(event index, id, size) of allocations, optionally of one category."""
    return [(i, a, s) for i, (op, c, a, s) in enumerate(zip(t.op, t.cat, t.id, t.size))
            if op == OP_ALLOC and (cat is None or c == cat)]


def _free_at(t: Trace) -> dict[int, int]:
    return {a: i for i, (op, a) in enumerate(zip(t.op, t.id)) if op == OP_FREE}


def _first(t: Trace, code: int, arg: int | None = None) -> int:
    return next(i for i, c, a in _marks(t) if c == code and (arg is None or a == arg))


def _live_at(t: Trace, index: int, cat: int) -> int:
    """Bytes of category ``cat`` live just before event ``index``."""
    live = 0
    for op, c, s in zip(t.op[:index], t.cat[:index], t.size[:index]):
        if c == cat and op in (OP_ALLOC, OP_FREE):
            live += s if op == OP_ALLOC else -s
    return live


def _check_marker_grammar(t: Trace, steps: int, micro: int, layers: int, recompute: bool = False) -> None:
    """Setup, then per step: k x (forward with nested layers, backward), optimizer."""
    seq = [(c, a) for _, c, a in _marks(t)]
    assert seq[:2] == [(MARK_SETUP_BEGIN, -1), (MARK_SETUP_END, -1)]
    pos = 2
    layer_marks = [m for i in range(layers) for m in ((MARK_LAYER_ENTER, i), (MARK_LAYER_EXIT, i))]
    back_marks = [m for i in reversed(range(layers)) for m in ((MARK_LAYER_ENTER, i), (MARK_LAYER_EXIT, i))]
    for step in range(steps):
        expect = [(MARK_ITER_BEGIN, step)]
        for m in range(micro):
            expect += [(MARK_FORWARD_BEGIN, m), *layer_marks, (MARK_FORWARD_END, m), (MARK_BACKWARD_BEGIN, m),
                       *(back_marks if recompute else []), (MARK_BACKWARD_END, m)]
        expect += [(MARK_OPTIMIZER_BEGIN, step), (MARK_OPTIMIZER_END, step), (MARK_ITER_END, step)]
        assert seq[pos:pos + len(expect)] == expect, f"step {step}"
        pos += len(expect)
    assert pos == len(seq)


# -- real captures ------------------------------------------------------------------------
def test_trace_is_valid_and_ids_dense(base: Trace) -> None:
    base.validate()
    allocated: set[int] = set()
    for op, a in zip(base.op, base.id):
        if op == OP_ALLOC:
            allocated.add(a)
        elif op == OP_FREE:
            assert a in allocated, f"free of id {a} before its alloc"
    assert allocated == set(range(base.n_ids))
    assert set(base.stream) == {0}
    sites = base.meta["sites"]
    assert all(-1 <= s < len(sites) for s in base.site)
    assert any("Attention" in s for s in sites) and any("Backward" in s for s in sites)


def test_parameters_persist_and_match_model(base: Trace) -> None:
    params = _allocs(base, CAT_PARAMETER)
    freed = _free_at(base)
    setup_end = _first(base, MARK_SETUP_END)
    assert params and all(i < setup_end for i, _, _ in params)
    assert not any(a in freed for _, a, _ in params)
    n_params = sum(p.numel() for p in build_model("gpt", **_overrides(64)).parameters())
    assert sum(s for _, _, s in params) == 4 * n_params


def _overrides(seq: int) -> dict:
    return dict(n_layers=TINY["layers"], dim=TINY["dim"], n_heads=TINY["heads"], vocab=TINY["vocab"], max_seq=seq)


def test_gradients_and_optimizer_state(base: Trace) -> None:
    param_bytes = sum(s for _, _, s in _allocs(base, CAT_PARAMETER))
    grads = _allocs(base, CAT_GRADIENT)
    assert grads[0][0] > _first(base, MARK_BACKWARD_BEGIN, 0)
    assert grads[0][0] < _first(base, MARK_BACKWARD_END, 0)
    for step in range(2):  # every step's gradients cover every parameter at the optimizer step
        assert _live_at(base, _first(base, MARK_OPTIMIZER_BEGIN, step), CAT_GRADIENT) == param_bytes
        assert _live_at(base, _first(base, MARK_ITER_END, step), CAT_GRADIENT) == 0  # zero_grad(set_to_none)
    states = _allocs(base, CAT_OPTIMIZER_STATE)
    opt0, opt0_end = _first(base, MARK_OPTIMIZER_BEGIN, 0), _first(base, MARK_OPTIMIZER_END, 0)
    assert states and all(opt0 < i < opt0_end for i, _, _ in states)
    freed = _free_at(base)
    assert not any(a in freed for _, a, _ in states)
    assert sum(s for _, _, s in states) == 2 * param_bytes  # AdamW exp_avg + exp_avg_sq


def test_temporaries_are_freed(base: Trace) -> None:
    temps = _allocs(base, CAT_TEMPORARY)
    freed = _free_at(base)
    assert temps and all(a in freed for _, a, _ in temps)


def test_markers_ordered_and_balanced(base: Trace) -> None:
    _check_marker_grammar(base, steps=2, micro=1, layers=LAYERS)


def test_layer_activations_lie_between_layer_markers(base: Trace) -> None:
    """Each layer's saved activations are allocated inside its enter/exit window; identical
    blocks save identical bytes."""
    bwd = _first(base, MARK_BACKWARD_BEGIN, 0)
    freed = _free_at(base)
    saved = {}
    for layer in range(LAYERS):
        enter, leave = _first(base, MARK_LAYER_ENTER, layer), _first(base, MARK_LAYER_EXIT, layer)
        assert enter < leave < bwd
        inside = [(a, s) for i, a, s in _allocs(base, CAT_ACTIVATION) if enter < i < leave]
        saved[layer] = sum(s for a, s in inside if freed.get(a, len(base)) > bwd)
    assert saved[0] > 0 and len(set(saved.values())) == 1


def test_recompute_lowers_peak(base: Trace) -> None:
    rec = capture("gpt", 2, 4, 64, recompute=True, progress=False, **TINY)
    rec.validate()
    _check_marker_grammar(rec, steps=2, micro=1, layers=LAYERS, recompute=True)
    assert summarize(rec)["peak_bytes"] < summarize(base)["peak_bytes"]
    fwd_act = lambda t: sum(s for i, _, s in _allocs(t, CAT_ACTIVATION)  # noqa: E731
                            if _first(t, MARK_FORWARD_BEGIN) < i < _first(t, MARK_FORWARD_END))
    assert fwd_act(rec) < fwd_act(base)


def test_grad_accumulation_and_bf16(accum_bf16: Trace) -> None:
    t = accum_bf16
    t.validate()
    _check_marker_grammar(t, steps=2, micro=2, layers=LAYERS)
    for step in range(2):
        lo, hi = _first(t, MARK_ITER_BEGIN, step), _first(t, MARK_ITER_END, step)
        assert sum(1 for i, c, _ in _marks(t) if c == MARK_FORWARD_BEGIN and lo < i < hi) == 2
    # gradients are allocated in the first micro-batch's backward only, then accumulated in place
    second = _first(t, MARK_BACKWARD_BEGIN, 1), _first(t, MARK_BACKWARD_END, 1)
    assert not any(second[0] < i < second[1] for i, _, _ in _allocs(t, CAT_GRADIENT))
    # bf16 autocast: some forward allocations are half the size of an fp32 tensor of the same shape
    cfg = make_config("llama", **_overrides(32))
    hidden = 2 * 32 * cfg.dim
    lo, hi = _first(t, MARK_FORWARD_BEGIN), _first(t, MARK_FORWARD_END)
    fwd = [s for i, _, s in _allocs(t) if lo < i < hi]
    assert 2 * hidden in fwd and 4 * hidden in fwd


def test_moe_routed_sizes_vary() -> None:
    t = capture("moe", 2, 2, 32, progress=False, **TINY)
    t.validate()
    expert = {i for i, s in enumerate(t.meta["sites"]) if s.startswith("MLP:")}
    by_step = []
    for step in range(2):
        lo = _first(t, MARK_ITER_BEGIN, step)
        hi = next(i for i, c, _ in _marks(t) if c == MARK_FORWARD_END and i > lo)
        by_step.append(sorted(sz for i, _, sz in _allocs(t) if lo < i < hi and t.site[i] in expert))
    assert by_step[0] and by_step[0] != by_step[1]


def test_site_and_host_scalar_rules() -> None:
    assert _site(("aten::empty", "aten::addmm", "aten::linear"), "Linear") == "Linear:aten::linear>aten::addmm"
    assert _site(("aten::mm", "autograd::engine::evaluate_function: MmBackward0"), "") == \
        "backward:MmBackward0>aten::mm"
    assert host_scalar(_Rec("alloc", size=8))  # Python number wrapped by the argument parser
    assert host_scalar(_Rec("alloc", size=4, ops=("aten::_to_copy", "aten::div")))
    assert not host_scalar(_Rec("alloc", size=4, ops=("aten::_to_copy", "aten::to")))  # a real cast
    assert not host_scalar(_Rec("alloc", size=4, ops=("aten::nll_loss_forward",)))  # the loss
    assert not host_scalar(_Rec("alloc", size=64))


def test_recordsto_trace() -> None:
    """Pre-existing memory becomes INIT_ALLOC up front; host scalars vanish with their free;
    identity decides the persistent categories; profiler-only claims are demoted."""
    recs = [_Rec("alloc", ptr=1, size=64, cat=CAT_PARAMETER, ops=("aten::empty",)),  # set-up weight
            _Rec("free", ptr=9, size=32),  # allocated before profiling
            _Rec("alloc", ptr=2, size=8),  # wrapped Python number
            _Rec("alloc", ptr=3, size=64, cat=CAT_ACTIVATION, ops=("aten::mm",)),  # becomes the gradient
            _Rec("free", ptr=2, size=8),
            _Rec("mark", code=MARK_OPTIMIZER_BEGIN, arg=0),
            _Rec("alloc", ptr=4, size=64, cat=CAT_PARAMETER, ops=("aten::sqrt",)),  # profiler mislabel
            _Rec("free", ptr=4, size=64),
            _Rec("mark", code=MARK_OPTIMIZER_END, arg=0)]
    t = to_trace(recs, Identity(grads={0: {3}}, params={1}), {}, keep_host_scalars=False)
    t.validate()
    ev = list(t.events())
    assert ev[0].op == OP_INIT_ALLOC and ev[0].size == 32
    assert [e.op for e in ev[1:]] == [OP_ALLOC, OP_FREE, OP_ALLOC, OP_MARK, OP_ALLOC, OP_FREE, OP_MARK]
    assert [e.cat for e in ev if e.op == OP_ALLOC] == [CAT_PARAMETER, CAT_GRADIENT, CAT_TEMPORARY]
    assert t.meta["host_scalars_dropped"] == 1 and t.n_ids == 4
    kept = to_trace(recs, Identity(), {}, keep_host_scalars=True)
    assert kept.n_ids == 5 and kept.meta["host_scalars_dropped"] == 0


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        capture("gpt", 0, progress=False)
    with pytest.raises(ValueError):
        capture("gpt", 1, 1, 8, mixed_precision="fp8", progress=False, **TINY)
    with pytest.raises(ValueError):
        capture("no-such-model", 1, 1, 8, progress=False)


def test_private_api_change_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.profiler._memory_profiler as mem

    monkeypatch.delattr(mem, "MemoryProfile")
    with pytest.raises(CaptureError, match=re.escape(torch.__version__)):
        profiler_records(object())


def test_progress_bar_only_on_a_tty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert list(_progress(3, True, "x")) == [0, 1, 2]
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert list(_progress(3, False, "x")) == [0, 1, 2]
    bar = _progress(3, True, "x")
    assert type(bar).__module__.startswith("tqdm") or importlib.util.find_spec("tqdm") is None
    assert list(bar) == [0, 1, 2]


def test_repeated_blocks_prefers_outer_list() -> None:
    m = build_model("moe", **_overrides(16))
    assert repeated_blocks(m) is m.layers


# -- fake captures --------------------------------------------------------------------------
def _llama_params(dim: int, ffn: int, vocab: int, layers: int, tp: int) -> int:
    """Llama-2 parameter count per tensor-parallel rank (MHA, SwiGLU, RMSNorm, untied head)."""
    per_layer = 4 * dim * dim // tp + 3 * dim * ffn // tp + 2 * dim
    return layers * per_layer + 2 * vocab // tp * dim + dim


def test_fake_7b_layer_uses_no_memory() -> None:
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t = fake_capture("llama", "7b", steps=1, batch=1, seq=512, layers=1, progress=False)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    t.validate()
    s = summarize(t)
    assert s["peak_bytes"] > 4 * 2**30  # params + grads + AdamW state of a 7b layer and embeddings
    assert grown < s["peak_bytes"] / 8, f"RSS grew {grown >> 20} MiB"
    expected = _llama_params(4096, 11008, 32000, 1, 1)
    assert param_count(make_config("llama", "7b", n_layers=1)) == expected
    assert sum(sz for _, _, sz in _allocs(t, CAT_PARAMETER)) == expected * 4
    assert sum(sz for _, _, sz in _allocs(t, CAT_OPTIMIZER_STATE)) == expected * 8
    _check_marker_grammar(t, steps=1, micro=1, layers=1)
    assert _live_at(t, _first(t, MARK_BACKWARD_BEGIN), CAT_ACTIVATION) > 0


def test_fake_tensor_parallel_slices_parameters() -> None:
    t = fake_capture("llama", "7b", steps=1, batch=1, seq=256, layers=2, tp=8, recompute=True, progress=False)
    t.validate()
    assert sum(sz for _, _, sz in _allocs(t, CAT_PARAMETER)) == 4 * _llama_params(4096, 11008, 32000, 2, 8)
    _check_marker_grammar(t, steps=1, micro=1, layers=2, recompute=True)
    with pytest.raises(ValueError):
        fake_capture("llama", "7b", layers=1, tp=3, progress=False)


# -- CLI ------------------------------------------------------------------------------------
def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "npu_pool.cli", "capture", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_capture_writes_trace(tmp_path: Path) -> None:
    out = tmp_path / "t.npt"
    r = _cli("--model", "gpt", "--steps", "1", "--batch", "2", "--seq", "16", "--layers", "1", "--dim", "32",
             "--no-progress", "--out", str(out))
    assert r.returncode == 0, r.stderr
    t = Trace.load(out)
    t.validate()
    s = summarize(t)
    assert f"allocs {s['allocs']}" in r.stdout and "peak live" in r.stdout and "parameter" in r.stdout


def test_cli_rejects_fake_without_shape(capsys: pytest.CaptureFixture) -> None:
    from npu_pool.cli import main

    assert main(["capture", "--fake"]) == 2
    assert "--shape" in capsys.readouterr().err
    # the sizes of a real capture: a fake one takes the shape's and drew the same trace without a word
    assert main(["capture", "--shape", "7b", "--dim", "64", "--heads", "2", "--seed", "3", "--no-progress"]) == 2
    assert "--dim, --heads, --seed apply to a real capture; a fake one" in capsys.readouterr().err
    assert main(["capture", "--shape", "7b", "--colocated", "2", "--keep-host-scalars"]) == 2
    assert "--keep-host-scalars apply to a real capture" in capsys.readouterr().err


def test_capture_repeats_a_run_whose_profile_cannot_be_read(monkeypatch):
    """torch's memory profiler occasionally rejects its own record: the run is repeated."""
    from npu_pool.capture import profile

    real, calls = profile._read_profile, []

    def flaky(prof):
        calls.append(1)
        if len(calls) == 1:
            raise AssertionError("duplicate outputs")  # what torch 2.13's data-flow check raises
        return real(prof)

    monkeypatch.setattr(profile, "_read_profile", flaky)
    trace = capture("gpt", steps=1, batch=1, seq=16, progress=False)
    assert len(calls) == 2 and len(trace) > 0
    monkeypatch.setattr(profile, "_read_profile", lambda prof: (_ for _ in ()).throw(AssertionError("always")))
    with pytest.raises(CaptureError, match="always"):
        capture("gpt", steps=1, batch=1, seq=16, progress=False)


@pytest.mark.parametrize("steps, grad_accum, says", [
    (1000, 1, r"capturing 1000 steps would hold about .* a step\) than the 0\.0 GiB.*capture at most 2 steps"),
    (1, 1000, r"capturing 1 steps of 1000 micro-batches would hold about .* a micro-batch\) than the 0\.0 GiB"
              r".*lower --grad-accum to at most 2"),
])
def test_a_capture_that_would_not_fit_in_memory_stops_after_two_micro_batches(
        monkeypatch: pytest.MonkeyPatch, steps: int, grad_accum: int, says: str) -> None:
    """The profiler holds every op of the run: a capture whose micro-batches, at the growth of its
    second one, would not fit in the memory the machine has stops early, saying how many would.
    Checked per step before, so one step of many micro-batches (--grad-accum) was never checked
    (a helper's review: 1.68 GB where 300 MiB were available)."""
    from npu_pool.capture import real

    if real._MemoryGuard._rss() is None or real._MemoryGuard._available() is None:
        unavailable("no /proc to measure memory with")
    monkeypatch.setattr(real._MemoryGuard, "_available", staticmethod(lambda: 1))  # nothing to spare
    monkeypatch.setattr(real, "_check_fits", lambda *a: None)  # (the check before the run would refuse it)
    seen: list[int] = []
    orig = real._MemoryGuard.check

    def counting(self: object, step: int) -> None:
        seen.append(step)
        orig(self, step)

    monkeypatch.setattr(real._MemoryGuard, "check", counting)
    monkeypatch.setattr(real._MemoryGuard, "_rss", staticmethod(lambda: (1 << 30) + (len(seen) << 20)))
    with pytest.raises(CaptureError, match=says):
        capture("gpt", steps=steps, grad_accum=grad_accum, batch=1, seq=8, layers=1, dim=32, heads=2, vocab=64,
                progress=False)
    assert seen == [0, 1]  # stopped after the second micro-batch, not after a thousand


def test_a_real_capture_too_large_for_the_host_is_refused_before_it_runs(capsys: pytest.CaptureFixture,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Sizes whose weights, gradients and AdamW states (or one micro-batch's logits) alone pass the
    host's available memory are refused in one line before anything is built (they failed half-way
    in torch's allocator with a traceback, or filled the host's memory); torch's own failure to
    allocate is one line too."""
    from npu_pool.capture import real
    from npu_pool.cli import main

    if real._MemoryGuard._available() is None:
        unavailable("no /proc to measure memory with")
    for argv in (["--dim", "1000000", "--layers", "1"], ["--batch", "1000000000"], ["--vocab", "100000000000"]):
        assert main(["capture", *argv, "--steps", "1", "--no-progress"]) == 1
        err = capsys.readouterr().err
        assert "GiB of host memory, more than the" in err and err.count("\n") == 1, err
    import npu_pool.capture as package

    def out_of_memory(*args: object, **kwargs: object) -> None:
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried "
                           "to allocate 12000000000000 bytes")

    monkeypatch.setattr(package, "capture", out_of_memory)
    assert main(["capture", "--steps", "1", "--no-progress"]) == 1
    assert "the host ran out of memory running the model" in capsys.readouterr().err
