"""Patches for MindSpeed / Megatron training scripts: import this module first.

With ``MEMORY_FRAGMENTATION=1`` importing it installs npu_pool as the device allocator
(settings: ``NPU_POOL_POLICY``, ``NPU_POOL_FRACTION``, ``NPU_POOL_CONFIG``; see
``npu_pool.config``). The import must come before the model is built and before any
tensor is moved to the device. Without an NPU or GPU it warns and leaves torch alone;
a bad setting, or an import that comes too late, stops the process with one line naming it
(exit status 2; :func:`install_memory_pool` called by hand raises instead). It also patches Megatron's
training loop (``mindspeed_patch.megatron``): phases for the pool, a per-iteration line
(``NPU_POOL_LOG_EVERY``) and per-rank reports (``NPU_POOL_REPORT_DIR``).

With the package installed, the start-up hook (``npu_pool_startup``) imports this module by
itself when torch has been imported and ``MEMORY_FRAGMENTATION`` is set: the explicit import
is then not needed, and harmless (installing and patching happen once per process).
"""
from __future__ import annotations

import sys
import warnings


def install_memory_pool() -> bool:
    """Install npu_pool when ``MEMORY_FRAGMENTATION=1``; returns whether it is installed."""
    from npu_pool.config import load, switched_on

    if not switched_on():  # off: the pool's other settings are not read (an A/B run flips the switch only)
        return False
    settings = load()
    from npu_pool.install import DeviceUnavailableError, install

    from .megatron import settings as megatron_settings

    megatron_settings()  # checked before the install: a bad one leaves torch's allocator in place

    try:
        install(policy=settings.policy, fraction=settings.fraction)
    except DeviceUnavailableError as e:
        warnings.warn(f"MEMORY_FRAGMENTATION=1, but npu_pool was not installed: {e}", RuntimeWarning, stacklevel=2)
        return False
    return True


def _at_import() -> None:
    """What importing the module does: install the pool, patch Megatron. A user's mistake (a bad
    setting, its plan file, an import after torch allocated) is one line on stderr and exit
    status 2, as with the start-up hook, which says it itself when it is the importer."""
    from .megatron import patch_megatron

    try:
        install_memory_pool()
        patch_megatron()
    except Exception as e:
        from npu_pool.config import ConfigError  # here: with the switch off nothing imports torch
        from npu_pool.install import InstallError
        from npu_pool.planner.plan import PlanError

        hook = sys.modules.get("npu_pool_startup")
        if not isinstance(e, (ConfigError, PlanError, InstallError)) or (hook is not None and hook.firing()):
            raise
        print(f"npu_pool: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


_at_import()
