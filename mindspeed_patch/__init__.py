"""Patches for MindSpeed / Megatron training scripts: import this module first.

With ``MEMORY_FRAGMENTATION=1`` importing it installs npu_pool as the device allocator
(settings: ``NPU_POOL_POLICY``, ``NPU_POOL_FRACTION``, ``NPU_POOL_CONFIG``; see
``npu_pool.config``). The import must come before the model is built and before any
tensor is moved to the device. Without an NPU or GPU it warns and leaves torch alone;
bad settings, or an import that comes too late, raise. It also patches Megatron's
training loop (``mindspeed_patch.megatron``): phases for the pool, a per-iteration line
(``NPU_POOL_LOG_EVERY``) and per-rank reports (``NPU_POOL_REPORT_DIR``).

With the package installed, the start-up hook (``npu_pool_startup``) imports this module by
itself when torch has been imported and ``MEMORY_FRAGMENTATION`` is set: the explicit import
is then not needed, and harmless (installing and patching happen once per process).
"""
from __future__ import annotations

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


install_memory_pool()

from .megatron import patch_megatron as _patch_megatron  # noqa: E402

_patch_megatron()
