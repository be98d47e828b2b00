"""Megatron / MindSpeed integration: phase markers, per-iteration memory lines, rank reports.

With ``MEMORY_FRAGMENTATION=1``, :func:`patch_megatron` (called when ``mindspeed_patch``
is imported) wraps, in ``megatron.training.training`` (and ``mindspeed_llm.training.training``
where MindSpeed-LLM re-binds them):

- ``setup_model_and_optimizer``: the set-up phase (model, weights, optimizer built there
  are long-lived), then :func:`npu_pool.recorder.attach` on the returned model chunks and
  optimizer: layer enter/exit in forward and backward (``TransformerBlock.layers``),
  forward/backward begin/end per micro-batch, the optimizer's ``step`` (the first one
  creates the long-lived optimizer states);
- ``train_step``: iteration boundaries, the step time, and every ``NPU_POOL_LOG_EVERY``
  iterations one line per rank (allocated, reserved, peak, utilization, long/short split,
  device mallocs);
- ``train_step``: iteration boundaries numbered with Megatron's own ``iteration`` (a resumed
  run goes on from its checkpoint's), the step time, skipped iterations (an optimizer step
  Megatron did not apply), and every ``NPU_POOL_LOG_EVERY`` iterations one line per rank;
- ``evaluate``: the eval phase (nothing made there outlives it);

and in ``megatron.core.pipeline_parallel.schedules`` (which the pipeline schedules call through
module globals) ``forward_step`` and ``backward_step``: forward and backward of each
micro-batch, whatever the schedule.

A module is patched when it is imported (an import hook waits for it), so names that
MindSpeed-LLM imports from it bind the wrapped functions; if it is already imported, the
originals bound elsewhere are replaced too. Where MindSpeed is installed, the wrappers are
registered through its patch manager (``mindspeed.patch_utils.MindSpeedPatchesManager``, as
``*_wrapper`` patches): MindSpeed rebuilds a patched function from its own list each time it
applies patches, so a wrapper it does not know would be dropped when a MindSpeed feature
replaces ``train_step``. Registered, npu_pool's wrapper runs around whatever replacement
MindSpeed applies, whichever of the two is imported first. A function missing in the
installed Megatron gives one warning naming it, never an error.

Each rank writes ``npu_pool_rank<N>.json`` into ``NPU_POOL_REPORT_DIR`` (when set) at exit,
and after its first training step and every ``REPORT_EVERY_S`` seconds of training, so that a
rank ended by a signal (torchrun stopping the ranks that outlive a failed one, a scheduler's time
limit, the kernel's out-of-memory killer: no exit handler runs) leaves its report as of then. A
process that neither ran a training step nor used the device (a launcher, the parent of spawned
ranks, a DataLoader worker) writes none; a rank forked from the process that patched reports as
a process of its own from its first step. ``npu-pool merge DIR`` puts the ranks side by side.

Without a device allocator (CPU, or no NPU/GPU: ``mindspeed_patch`` warns and does not
install one) the patch runs in *recorder* mode: it says so once, still marks phases, times
steps and writes reports, with host peak RSS and no device memory figures.
"""
from __future__ import annotations

import atexit
import functools
import importlib.abc
import os
import sys
import time
import warnings
import weakref
from types import ModuleType
from typing import Any, Callable, Mapping, Optional

LOG_EVERY = "NPU_POOL_LOG_EVERY"
REPORT_EVERY_S = 30.0  # seconds of training between two writes of the rank report (besides the first step's and exit's)
REPORT_DIR = "NPU_POOL_REPORT_DIR"
TARGET = "megatron.training.training"
SCHEDULES = "megatron.core.pipeline_parallel.schedules"
FUNCTIONS = ("setup_model_and_optimizer", "train_step", "evaluate")
# modules that may hold the functions: the functions, and whether a missing one deserves a warning
MODULES: dict[str, tuple[tuple[str, ...], bool]] = {
    TARGET: (FUNCTIONS, True),
    "mindspeed_llm.training.training": (FUNCTIONS, False),
    SCHEDULES: (("forward_step", "backward_step"), True),
}
_WRAPPED = "__npu_pool_wrapped__"

_session: Optional["_Session"] = None


def _after_fork_in_child() -> None:
    """A forked process records on its own from the fork: what it records before its first step
    (a rank's own set-up) is its, what its parent recorded is not (the parent reports it).
    Registered when the session is made, after the recorder's lock registered its own fork hook,
    so that the child's lock is its new one when this runs."""
    if _session is not None:
        _session.recorder.reset_summary()


def parse_log_every(value: Any, source: str = LOG_EVERY) -> int:
    """``NPU_POOL_LOG_EVERY``: a whole number >= 0 (0: no per-iteration line)."""
    from npu_pool.config import ConfigError, parse_int

    try:
        return parse_int(value, source)
    except ConfigError:
        raise ConfigError(f"{source}={value!r:.40} is not valid: use a whole number of iterations >= 0 "
                          "(e.g. 10; 0 turns the per-iteration line off)") from None


def settings(environ: Optional[Mapping[str, str]] = None) -> tuple[int, Optional[str]]:
    """``(NPU_POOL_LOG_EVERY, NPU_POOL_REPORT_DIR)``, checked (``ConfigError`` names a bad one):
    ``mindspeed_patch`` reads them before it installs the pool, so that a bad one leaves torch's
    allocator in place."""
    from npu_pool.config import parse_output_dir

    environ = os.environ if environ is None else environ
    every = environ.get(LOG_EVERY, "")
    report_dir = environ.get(REPORT_DIR, "").strip() or None
    if report_dir:  # a file there is said now, not when the report is due at exit
        parse_output_dir(report_dir, REPORT_DIR)
        report_dir = os.path.abspath(report_dir)  # (where it named at start: the run may change directory)
    return (parse_log_every(every) if every.strip() else 1), report_dir


class _Session:
    """What the patch keeps for one process: the recorder, step times, where to report."""

    def __init__(self, log_every: int, report_dir: Optional[str]):
        from npu_pool.recorder import default
        from npu_pool.recorder.report import StepTimes

        self.recorder = default
        self.pid = os.getpid()               # the process whose report this is (a forked child inherits it)
        self.log_every = log_every
        self.report_dir = report_dir
        self.iterations = 0                  # train_step calls of this process
        self.iteration: Optional[int] = None  # Megatron's number of the latest one
        self.skipped = 0                     # of them, optimizer steps Megatron did not apply
        self._backwards = 0                  # backward steps since the iteration began
        self._outputs: dict[int, tuple[Any, int]] = {}  # id(forward's output tensor) -> (weakref to it, micro-batch)
        self.step_times = StepTimes()          # (mean, max and last: a long run's steps are not kept)
        self.attachments: list[Any] = []
        self.patched: dict[str, list[str]] = {}
        self.written: Optional[str] = None
        self._reported_at: Optional[float] = None  # when training last wrote the report (perf_counter)
        self._report_failed = False  # a write during training failed (said once)
        self.exited = False  # the report at exit was written (atexit, or a multiprocessing finalizer)
        self._depth = 0
        self._rank_world: Optional[tuple[int, int]] = None  # (rank, world size) last seen in a distributed run
        from npu_pool.install import installed

        if installed():  # the pool itself is looked up per report: Megatron picks the device later
            self.mode, self.reason = "device", ""
        else:
            self.mode = "recorder"
            self.reason = _why_no_device()
            warnings.warn(f"npu_pool.megatron: {self.reason}; recording phase markers and step times only "
                          "(reports have mode 'recorder' and no device memory figures)", RuntimeWarning, stacklevel=3)

    # -- figures ---------------------------------------------------------------------------
    def pool(self) -> Any:
        """The installed pool of the current device (None in recorder mode). Looked up each
        time: Megatron sets each rank's device after this module is imported."""
        from npu_pool.install import current_pool

        return current_pool(start=False) if self.mode == "device" else None  # (a report starts no device)

    def rank_and_world(self) -> tuple[int, Optional[int]]:
        """This process's (rank, world size), as the run had them: a process group destroyed
        before the report at exit (as torch asks) no longer says them, and every rank wrote
        npu_pool_rank0.json; the last ones seen in training stand then."""
        from npu_pool.recorder import report

        rank, world = report.rank_and_world()
        if world is not None:
            self._rank_world = (rank, world)
        elif self._rank_world is not None:
            rank, world = self._rank_world
        return rank, world

    def report(self, final: bool = False) -> dict[str, Any]:
        from npu_pool.recorder import report

        rank, world = self.rank_and_world()
        pool = self.pool()
        stats = pool.stats() if pool is not None else None
        reason = self.reason or ("" if pool is not None else "no installed pool serves the current device")
        return report.build(rank=rank, world_size=world, mode=self.mode, reason=reason,
                            policy=getattr(pool, "policy", None), device=getattr(pool, "device", None),
                            iterations=self.iterations, step_times=self.step_times,
                            recorder_summary=self.recorder.summary(), stats=stats,
                            last_iteration=self.iteration, skipped_iterations=self.skipped, final=final)

    def after_step(self, seconds: float) -> None:
        """Count the step and write its line: never raises into training (it runs in the
        wrapper's finally, where it would also hide the step's own exception)."""
        self.iterations += 1
        self.step_times.add(seconds)
        self.rank_and_world()  # while the process group is up
        self._report_now()
        if self.log_every and self.iterations % self.log_every == 0:
            try:
                self._line()
            except Exception as e:  # stdout closed or a broken pipe (`| head`), a pool gone: the run goes on
                self.log_every = 0
                warnings.warn(f"npu_pool.megatron: the per-iteration line could not be written ({e!r:.200}); "
                              "no more lines from this rank", RuntimeWarning, stacklevel=2)

    def _line(self) -> None:
        from npu_pool.recorder import report

        # one write per line: ranks share the terminal, and an unbuffered print() writes
        # the text and its newline separately, so lines of two ranks could interleave
        it = self.iteration + 1 if self.iteration is not None else self.iterations  # Megatron counts from 1
        out = sys.stdout
        if out is None:  # started with stdout closed (`>&-`)
            raise OSError("standard output is closed")
        out.write(report.format_line(self.report(), it) + "\n")
        out.flush()

    def write_report(self, final: bool = False) -> Optional[str]:
        if not self.report_dir:
            return None
        from npu_pool.recorder import report

        self.written = str(report.write(self.report(final), self.report_dir))
        return self.written

    def _report_now(self) -> None:
        """Write the report after the first step and every REPORT_EVERY_S seconds: a rank killed
        by a signal runs no exit handler. A failure is said once; the next write is tried an
        interval later (a full disk, a folder removed: training goes on)."""
        now = time.perf_counter()
        if not self.report_dir or (self._reported_at is not None and now - self._reported_at < REPORT_EVERY_S):
            return
        self._reported_at = now
        try:
            self.write_report()
        except Exception as e:
            if not self._report_failed:
                self._report_failed = True
                warnings.warn(f"npu_pool.megatron: the rank report could not be written during training ({e!r:.200}); "
                              f"tried again every {REPORT_EVERY_S:g} s and at exit", RuntimeWarning, stacklevel=2)

    def adopt_if_forked(self) -> None:
        """A rank forked from the process that patched (multiprocessing's fork start method) trains
        as a process of its own: from its first step the session is its own, counted from zero,
        and so is its report (a forked helper that runs no step leaves the rank's alone)."""
        if self.pid == os.getpid():
            return
        from npu_pool.recorder.report import StepTimes

        self.pid, self.iterations, self.skipped, self.step_times = os.getpid(), 0, 0, StepTimes()
        # (the recorder's markers and phase times count from the fork: _after_fork_in_child)
        self.iteration = None
        self._reported_at, self._report_failed, self._rank_world, self.written = None, False, None, None
        self.exited = False
        from multiprocessing import util  # a multiprocessing process leaves by os._exit after its finalizers:
        util.Finalize(None, _at_exit, exitpriority=0)  # no atexit handler runs there

    def has_run(self) -> bool:
        """Whether this process trained or used the device: one that did neither (a launcher, the
        parent of spawned ranks, a DataLoader worker started with spawn) has nothing to report,
        and its empty report, written as rank 0 or under an inherited RANK, would replace the
        report of the rank that trained."""
        return self.iterations > 0 or self.pool() is not None

    # -- wrappers --------------------------------------------------------------------------
    def setup(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def setup_model_and_optimizer(*args: Any, **kwargs: Any) -> Any:
            with self.recorder.phase("setup"):
                result = original(*args, **kwargs)
            self._attach(result)
            return result

        return setup_model_and_optimizer

    def _attach(self, result: Any) -> None:
        from npu_pool.recorder import attach

        if not isinstance(result, tuple) or not result:
            warnings.warn("npu_pool.megatron: setup_model_and_optimizer returned no (model, optimizer, ...) tuple; "
                          "no layer, forward/backward or optimizer markers (call npu_pool.recorder.attach yourself)",
                          RuntimeWarning, stacklevel=3)
            return
        model = result[0]
        optimizer = result[1] if len(result) > 1 and callable(getattr(result[1], "step", None)) else None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # one clear message below instead
                att = attach(model, optimizer, recorder=self.recorder)
        except TypeError as e:
            warnings.warn(f"npu_pool.megatron: cannot hook the model ({e}); phases from train_step only",
                          RuntimeWarning, stacklevel=3)
            return
        except RuntimeError as e:  # attached by the caller already: its hooks send the markers
            warnings.warn(f"npu_pool.megatron: {e}; the markers come from that attachment",
                          RuntimeWarning, stacklevel=3)
            return
        if not att.blocks:
            warnings.warn("npu_pool.megatron: no TransformerBlock/MambaStack/ParallelTransformer layers found in the model; "
                          "no layer markers", RuntimeWarning, stacklevel=3)
        self.attachments.append(att)

    def train_step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def train_step(*args: Any, **kwargs: Any) -> Any:
            if self._depth:  # a wrapped train_step calling another: count the step once
                return original(*args, **kwargs)
            self.adopt_if_forked()
            pid = os.getpid()
            self._depth += 1
            self.iteration = _megatron_iteration(args, kwargs, self.iteration)
            self._backwards = 0
            self._outputs.clear()
            t0 = time.perf_counter()
            try:
                with self.recorder.step(self.iteration):
                    result = original(*args, **kwargs)
                self.skipped += _skipped(result)
                return result
            finally:
                self._depth -= 1
                if os.getpid() == pid:  # (a child forked inside the step and leaving through it ran no step)
                    self.after_step(time.perf_counter() - t0)

        return train_step

    def forward_step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def forward_step(*args: Any, **kwargs: Any) -> Any:
            micro = kwargs.get("current_microbatch", args[11] if len(args) > 11 else None)
            micro = micro if isinstance(micro, int) and not isinstance(micro, bool) else -1
            with self.recorder.phase("forward", micro):
                result = original(*args, **kwargs)
            out = _first_tensor(result[0] if isinstance(result, tuple) and result else None)
            if out is not None and micro >= 0 and getattr(out, "requires_grad", False):  # (its backward's micro-batch)
                self._outputs[id(out)] = (weakref.ref(out), micro)
            return result

        return forward_step

    def backward_step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def backward_step(*args: Any, **kwargs: Any) -> Any:
            # the micro-batch of the forward whose output this backward takes; else the k-th backward
            # of the iteration is micro-batch k (the interleaved schedule runs one backward per model
            # chunk and micro-batch: counted, chunk 0's first was numbered 2 of 0..7 with 2 chunks)
            out = _first_tensor(kwargs.get("output_tensor", args[1] if len(args) > 1 else None))
            ref, micro = self._outputs.pop(id(out), (None, -1)) if out is not None else (None, -1)
            if ref is None or ref() is not out:
                micro = self._backwards
            self._backwards += 1
            with self.recorder.phase("backward", micro):
                return original(*args, **kwargs)

        return backward_step

    def evaluate(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def evaluate(*args: Any, **kwargs: Any) -> Any:
            if self.recorder.state.is_open("eval"):
                return original(*args, **kwargs)
            with self.recorder.phase("eval"):
                return original(*args, **kwargs)

        return evaluate


def _why_no_device() -> str:
    return ("no device allocator is installed (no Ascend NPU through torch_npu and no CUDA GPU in this process, "
            "or install() failed: see the warning from mindspeed_patch)")


def _first_tensor(output: Any) -> Any:
    """A schedule's output tensor (forward_step returns it in a list unless unwrapped), or None."""
    import torch  # (imported by then: the schedules run it)

    if isinstance(output, (list, tuple)):
        output = output[0] if output else None
    return output if isinstance(output, torch.Tensor) else None


def _megatron_iteration(args: tuple, kwargs: dict, previous: Optional[int]) -> int:
    """Megatron's number of the iteration a ``train_step`` call runs: its ``iteration``
    argument (Megatron-LM >= 0.13), else ``args.curr_iteration``, else one more than the last."""
    it = kwargs.get("iteration", args[7] if len(args) > 7 else None)
    if not isinstance(it, int) or isinstance(it, bool):
        try:
            from megatron.training.global_vars import get_args

            it = getattr(get_args(), "curr_iteration", None)
        except Exception:  # no Megatron args (a stand-in, or set up another way)
            it = None
    if isinstance(it, int) and not isinstance(it, bool) and it >= 0:
        return it
    return 0 if previous is None else previous + 1


def _skipped(result: Any) -> int:
    """1 when ``train_step`` says it skipped the optimizer step (its second value), else 0."""
    if isinstance(result, tuple) and len(result) > 1 and isinstance(result[1], int) and not isinstance(result[1], bool):
        return 1 if result[1] else 0
    return 0


def _maker(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The session's wrapper of function ``name``, flagged so it is never applied twice."""
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        if getattr(original, _WRAPPED, False):
            return original
        assert _session is not None
        wrapped = getattr(_session, "setup" if name == "setup_model_and_optimizer" else name)(original)
        setattr(wrapped, _WRAPPED, True)
        return wrapped

    return make


def _mindspeed_manager() -> Any:
    """MindSpeed's patch manager when MindSpeed is installed, else None."""
    if "mindspeed.patch_utils" not in sys.modules:
        import importlib.util

        try:
            if importlib.util.find_spec("mindspeed") is None:
                return None
        except (ImportError, ValueError):
            return None
    try:
        from mindspeed.patch_utils import MindSpeedPatchesManager
    except Exception:  # an incompatible MindSpeed: patch directly
        return None
    return MindSpeedPatchesManager


# (module, function) -> the registered wrapper: MindSpeed keeps each wrapper once, by identity
_registered: dict[tuple[str, str], Callable[..., Any]] = {}


def _register_with_mindspeed(manager: Any, module: ModuleType, name: str) -> None:
    """Register our wrapper of ``module.name`` as a MindSpeed ``*_wrapper`` patch and apply it:
    MindSpeed then puts it around every replacement it applies, now or later."""
    key = (module.__name__, name)
    if key not in _registered:
        make = _maker(name)

        def wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
            return make(original)

        wrapper.__name__ = wrapper.__qualname__ = f"npu_pool_{name}_wrapper"  # MindSpeed's wrapper rule
        _registered[key] = wrapper
    full = f"{module.__name__}.{name}"
    info = getattr(manager, "patches_info", None)
    if isinstance(info, dict) and full not in info:
        # A new entry goes into a copy: this may run inside MindSpeed's apply_patches(), which
        # iterates the dict and imports the module we wait for (mindspeed_patch, or the start-up
        # hook, came first); adding to the dict it iterates would break it.
        manager.patches_info = dict(info)
    manager.register_patch(full, _registered[key])
    manager.patches_info[full].apply_patch()


def _patch_module(module: ModuleType, functions: tuple[str, ...], warn_missing: bool) -> list[str]:
    """Wrap the functions ``module`` has; returns their names."""
    assert _session is not None
    done = []
    manager = _mindspeed_manager()
    for name in functions:
        original = getattr(module, name, None)
        if original is None or not callable(original):
            if warn_missing:
                warnings.warn(f"npu_pool.megatron: {module.__name__}.{name} not found in this Megatron/MindSpeed "
                              f"version; {_CONSEQUENCE[name]}", RuntimeWarning, stacklevel=2)
            continue
        if manager is not None:
            try:
                _register_with_mindspeed(manager, module, name)
                done.append(name)
                continue
            except Exception as e:  # a MindSpeed whose manager works otherwise: wrap directly, and say so
                warnings.warn(f"npu_pool.megatron: MindSpeed's patch manager refused the wrapper of "
                              f"{module.__name__}.{name} ({e!r}); wrapped directly, so a MindSpeed patch applied "
                              "later may drop it", RuntimeWarning, stacklevel=2)
                original = getattr(module, name)
        if not getattr(original, _WRAPPED, False):
            wrapped = _maker(name)(original)
            setattr(module, name, wrapped)
            _rebind(original, wrapped, name)
        done.append(name)
    _session.patched[module.__name__] = done
    return done


_CONSEQUENCE = {
    "setup_model_and_optimizer": "no set-up phase and no automatic layer/forward/backward/optimizer markers "
                                 "(call npu_pool.recorder.attach(model, optimizer) after building them)",
    "train_step": "no iteration markers, no per-iteration line and no step times",
    "evaluate": "evaluation runs are not marked (their tensors may be learned as training ones)",
    "forward_step": "no forward marker per micro-batch from the pipeline schedules",
    "backward_step": "no backward marker per micro-batch from the pipeline schedules",
}


def _rebind(original: Any, wrapped: Any, name: str) -> None:
    """Replace ``original`` where other modules imported it by name before we patched."""
    for mod in list(sys.modules.values()):
        try:
            if getattr(mod, name, None) is original:
                setattr(mod, name, wrapped)
        except Exception:  # exotic modules (lazy proxies) may refuse attribute access
            continue


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches a module right after it is first imported (before anyone binds its names)."""

    def __init__(self, name: str, functions: tuple[str, ...], warn_missing: bool):
        self.name, self.functions, self.warn_missing = name, functions, warn_missing

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        spec = None
        for finder in sys.meta_path:  # whoever would have found it (path entries, editable installs)
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        loader, finder = spec.loader, self

        class _Loader(importlib.abc.Loader):
            def create_module(self, s: Any) -> Any:
                return loader.create_module(s)

            def exec_module(self, module: ModuleType) -> None:
                loader.exec_module(module)
                _remove_finder(finder)
                _patch_module(module, finder.functions, finder.warn_missing)

        spec.loader = _Loader()
        return spec


def _remove_finder(finder: Any) -> None:
    if finder in sys.meta_path:
        sys.meta_path.remove(finder)


def patch_megatron(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Patch Megatron when ``MEMORY_FRAGMENTATION=1``; returns whether it did (idempotent).

    Raises :class:`npu_pool.config.ConfigError` for a bad ``NPU_POOL_LOG_EVERY`` (or any
    bad npu_pool setting)."""
    global _session
    env = os.environ if environ is None else environ
    from npu_pool.config import load, switched_on

    if not switched_on(env):
        return False
    load(env)  # every setting checked, as the install did
    log_every, report_dir = settings(env)
    if _session is not None:
        _session.log_every, _session.report_dir = log_every, report_dir
        return True
    _session = _Session(log_every, report_dir)
    os.register_at_fork(after_in_child=_after_fork_in_child)  # (once: the session is made once per process)
    for name, (functions, warn) in MODULES.items():
        if name in sys.modules:
            _patch_module(sys.modules[name], functions, warn)
        elif not any(isinstance(f, _PatchOnImport) and f.name == name for f in sys.meta_path):
            sys.meta_path.insert(0, _PatchOnImport(name, functions, warn))
    atexit.register(_at_exit)
    return True


def _at_exit() -> None:
    # (a forked child that exits: not its report; a process that neither trained nor used the device: none)
    if _session is not None and _session.pid == os.getpid() and not _session.exited and _session.has_run():
        _session.exited = True
        try:
            _session.write_report(final=True)
        except OSError as e:
            print(f"npu_pool.megatron: could not write the rank report to {_session.report_dir}: {e}",
                  file=sys.stderr)


def session() -> Optional[_Session]:
    """The current patch session (None before :func:`patch_megatron` ran with the switch on)."""
    return _session


def write_report() -> Optional[str]:
    """Write this rank's report now (also done at exit); returns the file, or None without
    ``NPU_POOL_REPORT_DIR``. It is final: the caller's word (only the patch's own writes during
    training are not)."""
    return _session.write_report(final=True) if _session is not None else None


def _unpatch() -> None:
    """Forget the session and remove pending import hooks (tests only; wrapped functions stay)."""
    global _session
    for f in [f for f in sys.meta_path if isinstance(f, _PatchOnImport)]:
        sys.meta_path.remove(f)
    if _session is not None:
        for att in _session.attachments:
            att.detach()
    try:
        atexit.unregister(_at_exit)
    except Exception:
        pass
    _session = None
