"""The lifetime recorder: explicit phases, automatic structure hooks, what the core learns
from them, and a real megatron-core training run replayed under npu_pool and torch."""
from __future__ import annotations

import array
import time
from typing import Any

import pytest
import torch

import importlib

install_mod = importlib.import_module("npu_pool.install")
from npu_pool import recorder, replay
from npu_pool.pool import Pool
from npu_pool.recorder import Recorder, _mcore_cpu
from npu_pool.trace.format import (CAT_ACTIVATION, CAT_AUTOGRAD_DETAIL, CAT_GRADIENT, CAT_OPTIMIZER_STATE,
                                   CAT_PARAMETER, CAT_TEMPORARY, MARK_BACKWARD_BEGIN, MARK_BACKWARD_END,
                                   MARK_EVAL_BEGIN, MARK_EVAL_END, MARK_FORWARD_BEGIN, MARK_FORWARD_END,
                                   MARK_ITER_BEGIN, MARK_ITER_END, MARK_LAYER_ENTER, MARK_LAYER_EXIT, MARK_NAMES,
                                   MARK_OPTIMIZER_BEGIN, MARK_OPTIMIZER_END,
                                   OP_ALLOC, OP_FREE, OP_MARK, Trace)
from conftest import in_ci, mcore_missing, unavailable

MiB = 1 << 20
needs_mcore = pytest.mark.usefixtures("megatron_core")  # (conftest: fails in CI without megatron-core)


class Spy:
    """A pool stand-in that keeps the markers it is sent."""

    def __init__(self) -> None:
        self.marks: list[tuple[int, int]] = []

    def mark(self, code: int, arg: int) -> None:
        self.marks.append((code, arg))


def names(marks: list[tuple[int, int]]) -> list[tuple[str, int]]:
    return [(MARK_NAMES[c], a) for c, a in marks]


# -- explicit phases ---------------------------------------------------------------------
def test_markers_from_several_threads_keep_the_state_whole() -> None:
    """Backward hooks run on torch's autograd threads: markers from four threads sharing one
    phase object (as a decorated function is shared) raised IndexError out of a phase's exit and
    left stages open for good (the threads review, about 2 runs in 5). Each begin pairs with its
    own thread's end, and the pools see the markers in the order the state followed them."""
    import sys
    import threading

    spy, n = Spy(), 3000
    rec = Recorder([spy], profile=False)
    fwd, errors = rec.phase("forward", 7), []

    def worker(k: int) -> None:
        try:
            for _ in range(n):
                with rec.phase("backward", k):
                    with fwd:
                        pass
        except Exception as e:  # (reported below, with the rest)
            errors.append(repr(e))

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch as often as the interpreter lets them
    try:
        ts = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert errors == [] and rec.state.marks == len(spy.marks) == 4 * n * 4
    assert rec.state._open == [] and rec.state.stage is None
    ends = [a for c, a in spy.marks if MARK_NAMES[c] == "backward_end"]
    assert sorted(ends) == sorted(k for k in range(4) for _ in range(n))


def test_the_summary_reads_while_other_threads_mark() -> None:
    """summary() from one thread while another marks stages (autograd threads) and starts the counts
    again: one consistent reading. Before, it read the seconds per stage without the recorder's
    lock and raised 'dictionary changed size during iteration' (a review of the Python layer under
    threads: within 0.5 s, 3 of 3 runs)."""
    import sys
    import threading

    rec = Recorder([Spy()], profile=False)
    stop, errors, reads = threading.Event(), [], [0]

    def marker() -> None:
        while not stop.is_set():
            rec.reset_summary()  # a fresh, empty table: each stage below adds its key
            for stage in ("forward", "backward", "optimizer", "eval", "setup"):
                with rec.phase(stage):
                    pass

    def reader() -> None:
        while not stop.is_set():
            try:
                s = rec.summary()
                assert set(s["seconds"]) <= {"forward", "backward", "optimizer", "eval", "setup"}
                reads[0] += 1
            except Exception as e:  # (reported below)
                errors.append(repr(e))
                stop.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        ts = [threading.Thread(target=marker), threading.Thread(target=reader)]
        for t in ts:
            t.start()
        stop.wait(3)
        stop.set()
        for t in ts:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert errors == [] and reads[0] > 0


def test_a_listener_may_wait_for_a_marker_of_another_thread_and_phases_cross_threads() -> None:
    """(The lock that orders markers once covered the listeners too: a listener waiting for a
    thread that marks hung. A phase entered on one thread may be left on another, as hooks do.)"""
    import threading

    spy = Spy()
    rec = Recorder([spy], profile=False)
    finished: list[bool] = []

    def listener(code: int, arg: int) -> None:
        if MARK_NAMES[code] == "setup_begin":
            t = threading.Thread(target=lambda: rec.mark("optimizer_begin"))
            t.start()
            t.join(60)
            finished.append(not t.is_alive())

    rec.listen(listener)
    rec.mark("setup_begin")
    assert finished == [True]
    ev = rec.phase("eval")
    ev.__enter__()
    t = threading.Thread(target=lambda: ev.__exit__(None, None, None))
    t.start()
    t.join(60)
    assert names(spy.marks)[-2:] == [("eval_begin", -1), ("eval_end", -1)] and not rec.state.is_open("eval")


def test_phases_as_context_managers_and_decorators() -> None:
    spy, sim = Spy(), Pool("npu_pool", capacity=1 << 30)
    rec = Recorder([spy, sim])

    @rec.phase("optimizer")
    def opt_step() -> str:
        return "stepped"

    with rec.phase("setup"):
        pass
    with rec.step(7):
        with rec.micro_batch(1):
            with rec.phase("forward"):
                with rec.layer(3):
                    pass
        assert opt_step() == "stepped"
    with rec.phase("eval"):
        pass
    assert names(spy.marks) == [("setup_begin", -1), ("setup_end", -1), ("iter_begin", 7), ("forward_begin", 1),
                                ("layer_enter", 3), ("layer_exit", 3), ("forward_end", 1),
                                ("optimizer_begin", -1), ("optimizer_end", -1), ("iter_end", 7),
                                ("eval_begin", -1), ("eval_end", -1)]
    s = rec.summary()
    assert s["marks"] == len(spy.marks) and s["iterations"] == 1 and s["iteration"] == 7
    assert set(s["seconds"]) == {"setup", "forward", "optimizer", "eval"}
    sim.check()


def test_a_stage_inside_another_is_the_outer_ones_time() -> None:
    """An evaluation's forwards (Megatron's evaluate runs forward_step) were counted as forward time
    too: a report's forward seconds tripled with 20 evaluation iterations (a review under
    Megatron-LM, 2026-11-27). A recomputation's forward inside a backward is backward time."""
    rec = Recorder([Spy()])
    with rec.phase("eval"):
        for m in range(2):
            with rec.phase("forward", m):
                time.sleep(0.05)
    with rec.phase("backward", 0):
        with rec.phase("forward", 0):
            time.sleep(0.05)
    with rec.phase("forward", 0):
        time.sleep(0.005)
    s = rec.summary()["seconds"]
    assert s["eval"] >= 0.1 and s["backward"] >= 0.05 and 0.005 <= s["forward"] < min(s["eval"], s["backward"]), s


def test_reset_summary_counts_from_now_keeping_open_phases() -> None:
    """A process forked from the recorded one reports its own markers: the counts start again, and a
    phase open at the reset is still open, its time counted once it closes."""
    spy = Spy()
    rec = Recorder([spy])
    with rec.step(0), rec.phase("forward"):
        pass
    with rec.phase("setup"):
        rec.reset_summary()
        assert rec.summary() == {"marks": 0, "iterations": 0, "iteration": 0, "seconds": {}}
        assert rec.state.is_open("setup")
    with rec.step(1):
        pass
    s = rec.summary()
    assert s["marks"] == 3 and s["iterations"] == 1 and set(s["seconds"]) == {"setup"}


def test_a_micro_batch_holds_across_the_start_of_an_iteration_inside_it() -> None:
    """A step's start counts micro-batches from 0 again, unless the caller named one around it."""
    spy = Spy()
    rec = Recorder([spy])
    with rec.micro_batch(1), rec.step(7), rec.phase("forward"):
        pass
    with rec.step(8), rec.phase("forward"):
        pass
    assert names(spy.marks) == [("iter_begin", 7), ("forward_begin", 1), ("forward_end", 1), ("iter_end", 7),
                                ("iter_begin", 8), ("forward_begin", 0), ("forward_end", 0), ("iter_end", 8)]


def test_markers_by_name_and_bad_names_rejected() -> None:
    spy = Spy()
    rec = Recorder([spy])
    rec.mark("layer_enter", 2)
    rec.mark(MARK_LAYER_EXIT, 2)
    assert spy.marks == [(MARK_LAYER_ENTER, 2), (MARK_LAYER_EXIT, 2)]
    with pytest.raises(ValueError, match="unknown phase 'warmup'.*setup"):
        rec.phase("warmup")
    with pytest.raises(ValueError, match="unknown marker 'layer_start'"):
        rec.mark("layer_start")
    with pytest.raises(ValueError, match="unknown marker code 99"):
        rec.mark(99)
    assert len(spy.marks) == 2


def test_default_recorder_drives_the_installed_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy()
    monkeypatch.setattr(install_mod, "current_pool", lambda: spy)
    with recorder.phase("backward", 0):
        recorder.mark("layer_enter", 1)
    assert names(spy.marks) == [("backward_begin", 0), ("layer_enter", 1), ("backward_end", 0)]


# -- what the core learns from the markers -----------------------------------------------
class Classed:
    """A pool wrapper that keeps the class (long/short) the core placed each request as."""

    def __init__(self, pool: Pool):
        self.pool = pool
        self.life: dict[str, str] = {}

    def malloc(self, name: str, size: int) -> int:
        ptr = self.pool.malloc(size)
        self.life[name] = ("long", "short")[self.pool.history(1)[-1]["lifetime"] == 2]
        return ptr


def _iteration(rec: Recorder, p: Classed, i: int, act: int, tmp: int, grad: int, eval_: bool = False) -> dict[str, str]:
    """One training iteration of a layer-shaped program: an activation (forward -> backward),
    a forward temporary, a gradient (backward -> optimizer), a backward temporary, an
    optimizer temporary; then an evaluation forward if asked. Returns the classes."""
    p.life.clear()
    free = p.pool.free
    with rec.step(i):
        with rec.phase("forward", 0), rec.layer(0):
            a = p.malloc("act", act)
            free(p.malloc("fwd_tmp", tmp))
        with rec.phase("backward", 0), rec.layer(0):
            g = p.malloc("grad", grad)
            free(p.malloc("bwd_tmp", tmp))
            free(a)
        with rec.phase("optimizer", i):
            free(p.malloc("opt_tmp", grad))
            free(g)
    if eval_:
        with rec.phase("eval"), rec.phase("forward", 0), rec.layer(0):
            free(p.malloc("eval_act", act))
    return dict(p.life)


def test_core_learns_stage_lifetimes_and_adapts_to_new_shapes() -> None:
    with Pool("npu_pool", capacity=1 << 32) as pool:
        rec, p = Recorder([pool]), Classed(pool)
        with rec.phase("setup"):
            p.malloc("weight", 4 * MiB)
        assert p.life["weight"] == "long"
        first = _iteration(rec, p, 0, 3 * MiB, MiB, 4 * MiB)
        # first iteration, no history: per-stage defaults (forward long, backward short)
        assert first["act"] == "long" and first["bwd_tmp"] == "short"
        want = {"act": "long", "fwd_tmp": "short", "grad": "long", "bwd_tmp": "short", "opt_tmp": "short",
                "eval_act": "short"}
        assert _iteration(rec, p, 1, 3 * MiB, MiB, 4 * MiB, eval_=True) == want
        # a new sequence length: new sizes, new sites; learned again within one iteration
        _iteration(rec, p, 2, 5 * MiB, 2 * MiB, 4 * MiB)
        want.pop("eval_act")
        assert _iteration(rec, p, 3, 5 * MiB, 2 * MiB, 4 * MiB) == want
        # back to the first shape: its history is still there
        assert _iteration(rec, p, 4, 3 * MiB, MiB, 4 * MiB) == want
        pool.check()


class _MegatronStyleOptimizer:
    """A step() that returns (update_successful, grad_norm, zeros) as Megatron's optimizers do,
    skipping the steps in ``skip`` (an overflow) before making any state."""

    def __init__(self, pool: Pool, classed: "Classed", skip: set[int]) -> None:
        self.pool, self.p, self.skip, self.n = pool, classed, skip, 0

    def step(self) -> tuple:
        i, self.n = self.n, self.n + 1
        self.pool.free(self.p.malloc(f"found_inf {i}", 4096))  # every step: the overflow check's temporary
        if i in self.skip:
            return False, None, None
        self.p.malloc(f"state {i}", 8 * MiB)  # (the first applied step makes the states)
        return True, 1.0, 0


def test_optimizer_states_made_after_skipped_steps_are_long_lived() -> None:
    """The first optimizer step's requests default to long-lived (it makes the optimizer's states);
    with fp16 loss scaling Megatron's first steps are often skipped (an overflow: step() returns
    update_successful False before making them), and the states, made in a later step, were placed
    short-lived (a review under Megatron-LM, 2026-11-27). A skipped step ends with optimizer_end's
    argument OPTIMIZER_SKIPPED (attach reads Megatron's result), and the next step is the first again;
    a step that frees or makes nothing lasting (SGD without momentum) still counts."""
    from npu_pool.vocab import OPTIMIZER_SKIPPED

    with Pool("npu_pool", capacity=1 << 32) as pool:
        rec, p = Recorder([pool]), Classed(pool)
        model = _gpt()
        opt = _MegatronStyleOptimizer(pool, p, skip={0, 1})
        recorder.attach(model, opt, recorder=rec)
        for i in range(4):
            model(torch.randint(64, (2, 16)))
            opt.step()
        assert p.life["state 2"] == "long" and p.life["state 3"] == "short", p.life
        pool.check()
    with Pool("npu_pool", capacity=1 << 32) as pool:  # stateless steps: the first counts, as before
        rec, p = Recorder([pool]), Classed(pool)
        for i in range(3):
            with rec.step(i), rec.phase("optimizer", i):
                pool.free(p.malloc(f"tmp {i}", (i + 1) * MiB))
        assert [p.life[f"tmp {i}"] for i in range(3)] == ["long", "short", "short"]
        rec.mark("optimizer_begin", 3)
        p.malloc("after a skip", MiB)
        rec.mark("optimizer_end", OPTIMIZER_SKIPPED)  # a skipped step only undoes its own count
        rec.mark("optimizer_begin", 4)
        assert p.malloc("next", MiB) and p.life["next"] == "short"
        pool.check()


def test_layer_markers_do_not_end_a_stage() -> None:
    """An activation made in layer 0 and freed in the backward is long even though layer
    markers came between; a temporary that crosses a layer marker inside the forward is short."""
    with Pool("npu_pool", capacity=1 << 32) as pool:
        rec, p = Recorder([pool]), Classed(pool)
        for i in range(2):
            with rec.step(i):
                with rec.phase("forward", 0):
                    with rec.layer(0):
                        act = p.malloc("act", 3 * MiB)
                        tmp = p.malloc("tmp", MiB)
                    with rec.layer(1):
                        pool.free(tmp)
                with rec.phase("backward", 0):
                    pool.free(act)
        assert p.life == {"act": "long", "tmp": "short"}


# -- automatic structure -------------------------------------------------------------------
def _gpt(layers: int = 3, recompute: bool = False) -> torch.nn.Module:
    from npu_pool.workloads import build_model

    torch.manual_seed(0)
    m = build_model("gpt", n_layers=layers, dim=32, n_heads=2, vocab=64, max_seq=16)
    m.recompute = recompute
    return m


def _train(model: torch.nn.Module, opt: Any, steps: int, micro: int) -> None:
    for _ in range(steps):
        for _m in range(micro):
            x = torch.randint(64, (2, 17))
            (model(x[:, :-1], x[:, 1:]) / micro).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("recompute", [False, True])
def test_attach_marks_layers_passes_and_steps(recompute: bool) -> None:
    model = _gpt(recompute=recompute)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    spy = Spy()
    rec = Recorder([spy])
    handle = recorder.attach(model, opt, recorder=rec)
    assert [i for i, _ in handle.blocks] == [0, 1, 2]
    _train(model, opt, steps=2, micro=2)
    fwd = [m for i in range(3) for m in ((MARK_LAYER_ENTER, i), (MARK_LAYER_EXIT, i))]
    expect: list[tuple[int, int]] = []
    for step in range(2):
        expect.append((MARK_ITER_BEGIN, step))
        for m in range(2):
            expect += [(MARK_FORWARD_BEGIN, m), *fwd, (MARK_FORWARD_END, m), (MARK_BACKWARD_BEGIN, m)]
            for i in reversed(range(3)):  # backward: last layer first; recompute re-runs the forward inside
                # (its exit ended the backward's too until 2026-11-27: the backward's exit, the same
                # marker, was dropped as a repeat, and 46 of 72 MiB of a backward's allocations in a
                # capture with recompute were in no layer)
                expect.append((MARK_LAYER_ENTER, i))
                if recompute:
                    expect += [(MARK_LAYER_ENTER, i), (MARK_LAYER_EXIT, i)]
                expect.append((MARK_LAYER_EXIT, i))
            expect.append((MARK_BACKWARD_END, m))
        expect += [(MARK_OPTIMIZER_BEGIN, step), (MARK_OPTIMIZER_END, step), (MARK_ITER_END, step)]
    assert names(spy.marks) == names(expect)
    # evaluation: no grad, so an eval phase around the forward and no backward markers
    spy.marks.clear()
    with torch.no_grad():
        x = torch.randint(64, (2, 16))
        model(x)
    assert names(spy.marks) == names([(MARK_EVAL_BEGIN, -1), *fwd, (MARK_EVAL_END, -1)])
    handle.detach()
    spy.marks.clear()
    _train(model, opt, steps=1, micro=1)
    assert spy.marks == []


def test_a_loss_computed_outside_the_model_has_its_backward_in_the_backward() -> None:
    """The backward began when the gradient reached the model's output: a loss computed outside the model
    (F.cross_entropy(model(x), y)) ran its own backward, a vocabulary-sized gradient, between the forward
    and the backward, in no stage (a review of the recorder, a helper: the peak of such a loop was
    'step', and replays took the loss's gradient for a long-lived tensor). The backward begins where
    backward() is called; the markers stay in their order; detached, torch's backward is torch's again."""
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    spy = Spy()
    rec = Recorder([spy])
    seen: list = []

    class Probe(torch.autograd.Function):  # the first node the backward runs: the loss's
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            seen.append(rec.state.stage)
            return g

    original = torch.autograd.backward
    handle = recorder.attach(model, opt, recorder=rec)
    for _ in range(2):
        x = torch.randint(64, (2, 17))
        logits = model(x[:, :-1])
        Probe.apply(torch.nn.functional.cross_entropy(logits.reshape(-1, 64), x[:, 1:].reshape(-1))).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert seen == ["backward", "backward"]
    codes = [c for c, _ in spy.marks]
    assert codes.count(MARK_BACKWARD_BEGIN) == codes.count(MARK_BACKWARD_END) == 2
    assert codes.index(MARK_FORWARD_END) < codes.index(MARK_BACKWARD_BEGIN) < codes.index(MARK_BACKWARD_END)
    handle.detach()
    assert torch.autograd.backward is original


def test_a_backward_that_raises_does_not_stop_the_markers() -> None:
    """A backward that raised never ran its end callback: the stage stayed "backward" and no later
    forward, optimizer or iteration was marked (an OOM-skip loop lost every marker after its first
    skip). The next forward ends it, and the iteration of the step the loop skipped (since
    2026-11-27: the next step was its second micro-batch)."""

    def boom(g: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("out of memory in backward")

    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    spy = Spy()
    rec = Recorder([spy])
    recorder.attach(model, opt, recorder=rec)
    x = torch.randint(64, (2, 17))
    hook = next(model.parameters()).register_hook(boom)  # late in backward: after its begin marker
    with pytest.raises(RuntimeError, match="out of memory in backward"):
        model(x[:, :-1], x[:, 1:]).backward()  # the loop skips this step
    hook.remove()
    opt.zero_grad(set_to_none=True)
    assert rec.state.stage == "backward"
    spy.marks.clear()
    _train(model, opt, steps=1, micro=1)
    got = names(spy.marks)
    assert got[:4] == [("backward_end", 0), ("iter_end", 0), ("iter_begin", 1), ("forward_begin", 0)], got
    assert ("optimizer_end", 1) in got and got[-1] == ("iter_end", 1) and rec.state.stage is None


def test_a_begin_without_its_end_is_dropped_at_the_iteration_bound() -> None:
    """A forward_begin never ended stayed open for good: one more entry kept per iteration, and the
    forward time was never counted again (balanced phases after it were inner ones)."""
    rec = Recorder([Spy()])
    for it in range(50):
        with rec.step(it):
            rec.mark("forward_begin", 0)  # no end
            with rec.phase("backward", 0):
                pass
    assert len(rec.state._open) == 0 and rec.state.stage is None
    with rec.step(50):
        with rec.phase("forward", 0):
            pass
    assert rec.state.seconds.get("forward", 0) > 0


def test_attach_leaves_explicit_phases_alone_and_wraps_megatron_style_optimizers() -> None:
    """Explicit phases win over the hooks' (no double forward/backward markers), and an
    optimizer that is not a torch.optim.Optimizer (Megatron's wrap torch's) gets its step
    wrapped, and restored on detach."""
    model = _gpt(layers=2)

    class MegatronStyle:
        def __init__(self, inner: torch.optim.Optimizer):
            self.inner = inner

        def step(self) -> tuple[bool, float, int]:
            self.inner.step()
            return True, 0.0, 0

    opt = MegatronStyle(torch.optim.SGD(model.parameters(), lr=0.1))
    spy = Spy()
    rec = Recorder([spy])
    with recorder.attach(model, opt, recorder=rec):
        with rec.step(0):
            with rec.phase("forward", 0):
                loss = model(*torch.randint(64, (2, 2, 16)).unbind(0))
            with rec.phase("backward", 0):
                loss.backward()
            assert opt.step() == (True, 0.0, 0)
        assert "step" in vars(opt)
    assert "step" not in vars(opt)
    seq = names(spy.marks)
    assert seq.count(("forward_begin", 0)) == 1 and seq.count(("backward_begin", 0)) == 1
    assert seq[-3:] == [("optimizer_begin", 0), ("optimizer_end", 0), ("iter_end", 0)]
    assert [a for n, a in seq if n == "layer_enter"] == [0, 1, 1, 0]


def test_find_blocks_megatron_stacks_and_fallbacks() -> None:
    class Layer(torch.nn.Module):
        def __init__(self, n: int):
            super().__init__()
            self.layer_number = n
            self.lin = torch.nn.Linear(4, 4)

    class ParallelTransformer(torch.nn.Module):  # legacy Megatron's container, by name
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(Layer(n) for n in (5, 6))  # a later pipeline stage: 1-based 5, 6

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = torch.nn.Sequential(torch.nn.Linear(4, 4), ParallelTransformer())

    found = recorder.find_blocks([Wrapped()])
    assert [i for i, _ in found] == [4, 5] and all(isinstance(b, Layer) for _, b in found)
    for name in ("MambaStack", "HybridStack"):  # Megatron's hybrid stacks, mixed layer classes in .layers
        stack = type(name, (torch.nn.Module,), {})()
        stack.layers = torch.nn.ModuleList([Layer(1), torch.nn.Linear(4, 4), Layer(3)])
        assert [i for i, _ in recorder.find_blocks(stack)] == [0, 1, 2]
    assert [i for i, _ in recorder.find_blocks(_gpt(layers=2))] == [0, 1]
    with pytest.warns(RuntimeWarning, match="no repeated blocks"):
        h = recorder.attach(torch.nn.Linear(2, 2), recorder=Recorder([]))
    assert h.blocks == []
    with pytest.raises(TypeError, match="nn.Module"):
        recorder.attach("model")


def test_find_blocks_takes_a_hugging_face_moe_models_layers_not_its_experts() -> None:
    """A Hugging Face MoE model (ForCausalLM -> .model.layers, each layer's mlp.experts a list of
    more experts than there are layers: Qwen-MoE, DeepSeek, OLMoE) got layer 0's 16 experts as its
    blocks, and layers 1-3 no marker (a review, 2026-11-27); GPT-2's `transformer.h` likewise."""
    def block() -> torch.nn.Module:
        b = torch.nn.Module()
        b.attn, b.mlp = torch.nn.Linear(4, 4), torch.nn.Module()
        b.mlp.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(16))
        return b

    for inner, attr in (("model", "layers"), ("transformer", "h")):
        top, body = torch.nn.Module(), torch.nn.Module()
        setattr(body, attr, torch.nn.ModuleList(block() for _ in range(4)))
        setattr(top, inner, body)
        top.lm_head = torch.nn.Linear(4, 4)
        assert [b for _, b in recorder.find_blocks(top)] == list(getattr(body, attr))


@needs_mcore
def test_find_blocks_megatron_core_transformer_block() -> None:
    _mcore_cpu.init()
    model = _mcore_cpu.gpt(layers=3, hidden=32, heads=2, vocab=64, seq=16)
    found = recorder.find_blocks(model)
    assert [i for i, _ in found] == [0, 1, 2]
    assert {type(b).__name__ for _, b in found} == {"TransformerLayer"}


# -- traces: markers recorded, replayed ----------------------------------------------------
def test_capture_carries_recorder_markers() -> None:
    from npu_pool.capture import capture

    t = capture("gpt", markers="auto", steps=1, batch=2, seq=16, layers=2, dim=32, heads=2, vocab=64, progress=False)
    t.validate()
    seq = [(MARK_NAMES[c], a) for op, c, a in zip(t.op, t.cat, t.id) if op == OP_MARK]
    assert seq[:2] == [("setup_begin", -1), ("setup_end", -1)]
    bwd = seq.index(("backward_begin", 0))
    assert seq[bwd + 1:seq.index(("backward_end", 0))] == [("layer_enter", 1), ("layer_exit", 1),
                                                            ("layer_enter", 0), ("layer_exit", 0)]
    assert t.meta["markers"] == "auto"


def _device_view(t: Trace) -> Trace:
    """The trace as a device allocator sees it: markers and sizes, no caller sites."""
    return Trace(meta=t.meta, op=t.op, cat=t.cat, site=array.array("i", [-1]) * len(t), id=t.id, size=t.size,
                 stream=t.stream, addr=t.addr)


def _steady_accuracy(t: Trace, classes: array.array) -> float:
    """Share of bytes allocated after the first iteration whose class matches what the
    tensor is: parameters, gradients, optimizer state and activations still live when
    the forward ends are long; temporaries, autograd detail and forward outputs the
    forward frees are short."""
    stage, span, it = None, 0, -1
    born: dict[int, tuple[int, int, str | None, int]] = {}
    right = total = 0
    stages = {MARK_FORWARD_BEGIN: "forward", MARK_BACKWARD_BEGIN: "backward", MARK_OPTIMIZER_BEGIN: "optimizer"}

    def score(i: int, cat: int, size: int, where: str | None, inside: bool) -> None:
        nonlocal right, total
        if cat in (CAT_PARAMETER, CAT_GRADIENT, CAT_OPTIMIZER_STATE):
            want = 1
        elif cat in (CAT_TEMPORARY, CAT_AUTOGRAD_DETAIL):
            want = 2
        elif cat == CAT_ACTIVATION:
            want = 2 if inside and where == "forward" else 1
        else:
            return
        total += size
        right += size if classes[i] == want else 0

    for i, (op, cat, id_, size) in enumerate(zip(t.op, t.cat, t.id, t.size)):
        if op == OP_MARK and cat not in (MARK_LAYER_ENTER, MARK_LAYER_EXIT):
            span += 1
            stage = stages.get(cat)
            it = id_ if cat == MARK_ITER_BEGIN else it
        elif op == OP_ALLOC:
            born[id_] = (i, span, stage, it)
        elif op == OP_FREE and id_ in born:
            j, s, where, at = born.pop(id_)
            if at >= 1:
                score(j, t.cat[j], t.size[j], where, s == span)
    for j, _s, where, at in born.values():
        if at >= 1:
            score(j, t.cat[j], t.size[j], where, False)
    return right / total


def _workload() -> tuple[str, Any, Any]:
    """(name, build(), loss(model, generator)): megatron-core's GPTModel when megatron-core is
    installed, else the project's GPT (a fresh clone without the optional package; in CI, which
    installs it, its absence fails)."""
    if in_ci() and mcore_missing():
        unavailable(mcore_missing())
    if _mcore_cpu.available():
        _mcore_cpu.init()
        return ("megatron-core GPTModel", lambda: _mcore_cpu.gpt(layers=3, hidden=192, heads=4, vocab=512, seq=128),
                lambda m, g: _mcore_cpu.loss(m, _mcore_cpu.batch(4, 128, 512, g)))
    from npu_pool.workloads import build_model

    def loss(m: torch.nn.Module, g: torch.Generator) -> torch.Tensor:
        x = torch.randint(512, (4, 129), generator=g)
        return m(x[:, :-1], x[:, 1:])

    return ("project GPT", lambda: build_model("gpt", n_layers=3, dim=192, n_heads=4, vocab=512, max_seq=128), loss)


def test_training_under_the_recorder_npu_pool_reserves_less_than_torch() -> None:
    """Real CPU training (megatron-core's GPTModel, 2 micro-batches per step) under attach();
    its trace, replayed as a device sees it, needs a smaller device under npu_pool than under
    torch's allocator model (minimum capacity: with room to spare the arena holds up to one growth
    chunk, 20 MiB, beyond its tensors, which on a model this small is torch's whole slack), and after
    the first step the learned classes match what the tensors are."""
    from npu_pool.capture import record_trace

    name, build, loss = _workload()

    def train(rec: Recorder) -> tuple[Any, Any]:
        gen = torch.Generator().manual_seed(0)
        torch.manual_seed(0)
        with rec.phase("setup"):
            model = build()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        with recorder.attach(model, opt, recorder=rec):
            for _ in range(3):
                for _micro in range(2):
                    (loss(model, gen) / 2).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        return model, opt

    t = record_trace(train)
    t.validate()
    marks = [MARK_NAMES[c] for op, c in zip(t.op, t.cat) if op == OP_MARK]
    assert marks.count("iter_begin") == 3 and marks.count("forward_begin") == 6 and marks.count("layer_enter") == 36
    dev = _device_view(t)
    classes = array.array("B", bytes(len(dev)))
    ours = replay.run(dev, "npu_pool", classes=classes)
    theirs = replay.run(dev, "torch")
    assert ours.ok and theirs.ok
    assert replay.min_capacity(dev, "npu_pool")[0] < replay.min_capacity(dev, "torch")[0], name
    assert ours.peak_live_bytes <= ours.peak_reserved_bytes <= ours.peak_live_bytes + 20 * (1 << 20)
    assert _steady_accuracy(t, classes) >= 0.95, name


def test_with_recompute_a_layers_backward_allocations_stay_in_that_layer() -> None:
    """Activation checkpointing runs a layer's forward again inside its backward: its markers nest
    inside the backward's for that layer. The backward's exit, the same marker as the recompute's,
    was dropped as a repeat, and the analysis's tracker closed both at the inner exit: 46 of 72 MiB
    of the second step's backward allocations in a capture with recompute were in no layer, 4.8
    without (a review, 2026-11-27)."""
    from npu_pool.analysis.phases import PhaseTracker
    from npu_pool.capture import capture
    from npu_pool.trace.format import MARK_LAYER_ENTER, MARK_LAYER_EXIT, OP_ALLOC, OP_MARK

    outside = {}
    for rc in (False, True):
        t = capture("llama", steps=2, layers=3, recompute=rc, progress=False, markers="auto")
        marks = [(c, i) for o, c, i in zip(t.op, t.cat, t.id) if o == OP_MARK]
        assert sum(c == MARK_LAYER_ENTER for c, _ in marks) == sum(c == MARK_LAYER_EXIT for c, _ in marks)
        tr, outside[rc] = PhaseTracker(), 0
        for o, c, i, size in zip(t.op, t.cat, t.id, t.size):
            if o == OP_MARK:
                tr.mark(c, i)
            elif o == OP_ALLOC and tr.stage == "backward" and tr.iteration == 1 and not tr.layers:
                outside[rc] += size
    assert 0 < outside[True] <= outside[False] * 1.25, outside
    tr = PhaseTracker()
    for c, i in ((MARK_LAYER_ENTER, 2), (MARK_LAYER_ENTER, 2), (MARK_LAYER_EXIT, 2)):
        tr.mark(c, i)
    assert tr.layers == [2]  # the recomputation's exit closes the inner one only


def test_attached_without_an_optimizer_each_forward_is_micro_batch_0() -> None:
    """With no optimizer (and nothing else marking steps) the micro-batch index counted every
    forward of the run (0, 1, 2, ...), each after the first flagged to the pool as a later
    micro-batch of one endless iteration (a review, 2026-11-27)."""
    model = _gpt()
    spy = Spy()
    recorder.attach(model, recorder=Recorder([spy]))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    _train(model, opt, steps=3, micro=1)
    begins = [(c, a) for c, a in spy.marks if c in (MARK_FORWARD_BEGIN, MARK_BACKWARD_BEGIN)]
    assert begins == [(MARK_FORWARD_BEGIN, 0), (MARK_BACKWARD_BEGIN, 0)] * 3


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_step_a_loop_skips_on_an_error_is_an_iteration_of_its_own(where: str) -> None:
    """A loop that catches an error raised in the forward or the backward (an out-of-memory, a NaN
    check) and goes on to the next batch: the step never reached optimizer.step(), its iteration
    stayed open, and the next step was marked as its second micro-batch (a review, 2026-11-27)."""
    model = _gpt()
    spy = Spy()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    recorder.attach(model, opt, recorder=Recorder([spy]))
    fail = {"on": False}

    def raise_in_forward(*_: Any) -> None:
        if fail["on"]:
            raise RuntimeError("simulated out of memory")

    def raise_in_backward(grad: torch.Tensor) -> torch.Tensor:
        if fail["on"]:
            raise RuntimeError("nan in a gradient")
        return grad

    block = [b for _, b in recorder.find_blocks(model)][1]
    if where == "forward":
        block.register_forward_pre_hook(raise_in_forward)
    else:
        next(block.parameters()).register_hook(raise_in_backward)
    for step in range(3):
        fail["on"] = step == 1
        x = torch.randint(64, (2, 17))
        try:
            model(x[:, :-1], x[:, 1:]).backward()
            opt.step()
        except RuntimeError:
            pass
        opt.zero_grad(set_to_none=True)
    its = [(MARK_NAMES[c], a) for c, a in spy.marks if c in (MARK_ITER_BEGIN, MARK_ITER_END, MARK_FORWARD_BEGIN)]
    assert its == [x for i in range(3) for x in (("iter_begin", i), ("forward_begin", 0), ("iter_end", i))], its


def test_a_model_attached_twice_is_refused_and_a_bad_optimizer_leaves_no_hooks() -> None:
    """Attaching a model that is attached sent every marker twice (a forward showed each layer
    entered twice); attach with an optimizer it cannot hook raised after hooking the model, so the
    hooks it left (no handle to remove them) marked every later forward (2026-11-27)."""
    model = _gpt()
    spy = Spy()
    rec = Recorder([spy])
    with pytest.raises(TypeError, match="step"):
        recorder.attach(model, optimizer=object(), recorder=rec)
    model(torch.randint(64, (2, 16)))
    assert spy.marks == []
    handle = recorder.attach(model, recorder=rec)
    with pytest.raises(RuntimeError, match="already attached"):
        recorder.attach([model], recorder=rec)
    model(torch.randint(64, (2, 16)))
    entered = [a for c, a in spy.marks if c == MARK_LAYER_ENTER]
    assert entered == [0, 1, 2]
    handle.detach()
    again = recorder.attach(model, recorder=rec)  # detached: attaching again is fine
    spy.marks.clear()
    model(torch.randint(64, (2, 16)))
    assert [a for c, a in spy.marks if c == MARK_LAYER_ENTER] == [0, 1, 2]
    # attached before its optimizer existed (a model provider): attach(model, optimizer) hooks the
    # step into that attachment (Megatron's set-up wrapper does it after set-up)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert recorder.attach(model, opt, recorder=rec) is again
    spy.marks.clear()
    opt.step()
    assert names(spy.marks) == [("optimizer_begin", -1), ("optimizer_end", -1)]
    with pytest.raises(RuntimeError, match="already attached"):  # its step hooked already
        recorder.attach(model, opt, recorder=rec)
    again.detach()

    class ReadOnlyStep:  # a step that cannot be wrapped (it raised AttributeError, the model's hooks left on)
        @property
        def step(self) -> Any:
            return lambda: None

    with pytest.raises(TypeError, match="cannot wrap ReadOnlyStep.step"):
        recorder.attach(model, ReadOnlyStep(), recorder=rec)
    spy.marks.clear()
    model(torch.randint(64, (2, 16)))
    assert spy.marks == []
    recorder.attach(model, recorder=rec).detach()
