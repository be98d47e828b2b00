"""The start-up hook behind ``export MEMORY_FRAGMENTATION=1``.

Installing the package puts ``npu_pool_startup.pth`` into site-packages. Python runs its one
line in every process it starts (torchrun's workers included); the line reads one variable
and imports nothing, so it costs microseconds (``benchmarks/startup_hook.py``). Only
when ``MEMORY_FRAGMENTATION`` (or ``NPU_POOL_CONFIG``) is set does it import this module and
call :func:`arm`, which adds an import hook and returns. When ``torch`` has finished
importing (and ``torch_npu`` with it, whether torch's device-backend autoload or the script
imported it), the hook does what ``import mindspeed_patch`` does: it reads the settings
and, when the switch is on, installs npu_pool as the device allocator (before any tensor
can reach the device) and patches Megatron's training loop when Megatron is imported.

A bad setting stops the process with one line naming it (exit status 2) at ``import torch``;
processes that never import torch are never touched. torchrun's launcher process, which
imports torch but never allocates device memory, is left alone.

Kept outside the ``npu_pool`` package so that arming imports nothing else.
"""
from __future__ import annotations

import os
import sys

ENABLE = "MEMORY_FRAGMENTATION"
CONFIG_FILE = "NPU_POOL_CONFIG"
PTH = "npu_pool_startup.pth"
# The line the .pth holds (setup.py writes it). A .pth line that starts with "import" is
# executed by site.py; everything else is on this one line so that nothing is imported
# while the switch is off.
PTH_LINE = (f"import os; (os.environ.get({ENABLE!r}, '').strip() not in ('', '0') or os.environ.get({CONFIG_FILE!r}))"
            " and __import__('npu_pool_startup').arm()\n")
WATCHED = ("torch", "torch_npu")  # the switch fires when the last of these that is importing has finished

_importing: set[str] = set()
_state = {"armed": False, "fired": False, "firing": False}


def arm() -> None:
    """Watch for ``import torch`` (called by the .pth line; idempotent)."""
    if _state["armed"]:
        return
    _state["armed"] = True
    if "torch" in sys.modules:  # armed late (by hand, after torch): fire now
        fire()
        return
    sys.meta_path.insert(0, _Watch())


def _launcher() -> bool:
    """torchrun's (or torch.distributed.launch's) parent process: it starts the workers."""
    argv0 = (sys.argv[0] if sys.argv else "").replace("\\", "/")
    if argv0.rsplit("/", 1)[-1] == "torchrun" or argv0.endswith(("distributed/run.py", "distributed/launch.py")):
        return True
    orig = list(getattr(sys, "orig_argv", []))  # `python -m torch.distributed.run`: argv[0] is still "-m" here
    return any(a == "-m" and b in ("torch.distributed.run", "torch.distributed.launch") for a, b in zip(orig, orig[1:]))


def fire() -> None:
    """Install the pool and patch Megatron, once, as ``import mindspeed_patch`` does."""
    if _state["fired"]:
        return
    _state["fired"] = True
    for f in [f for f in sys.meta_path if isinstance(f, _Watch)]:
        sys.meta_path.remove(f)
    if _launcher():
        return
    from npu_pool.config import ConfigError
    from npu_pool.install import InstallError
    from npu_pool.planner.plan import PlanError

    _state["firing"] = True
    try:
        import mindspeed_patch  # noqa: F401  (installs the pool and patches Megatron when the switch is on)
    except (ConfigError, PlanError, InstallError) as e:  # a setting, its plan file, or the install it asked for
        print(f"npu_pool: {e} (the start-up hook reads it because {ENABLE} or {CONFIG_FILE} is set)",
              file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    finally:
        _state["firing"] = False


def firing() -> bool:
    """Whether the hook is importing ``mindspeed_patch`` now (it then reports a bad setting itself)."""
    return _state["firing"]


class _Watch:
    """A meta-path finder that wraps the loaders of torch and torch_npu to learn when their
    import has finished; it finds nothing itself."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> object:
        if fullname not in WATCHED or fullname in _importing:
            return None
        spec = None
        for finder in sys.meta_path:  # whoever would have found it
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module: object) -> None:
            _importing.add(fullname)
            try:
                original(module)
            finally:
                _importing.discard(fullname)
            if not _importing and "torch" in sys.modules:
                fire()

        try:  # the loader keeps its type (torch reads its own __spec__); only this call is wrapped
            loader.exec_module = exec_module
        except (AttributeError, TypeError):
            return spec
        return spec
