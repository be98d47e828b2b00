"""torch's allocator settings (``PYTORCH_NPU_ALLOC_CONF``, ``PYTORCH_ALLOC_CONF``,
``PYTORCH_CUDA_ALLOC_CONF``) once npu_pool is the allocator: none of them reaches npu_pool, so
:func:`ignored_message` names each one set and what npu_pool does instead, in one line that
``install()`` warns with. Pure Python: no torch, no core.

The format is torch's: ``key:value`` pairs separated by commas (``expandable_segments:True,
max_split_size_mb:128``). An entry without a colon is named as it is.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

VARIABLES = ("PYTORCH_NPU_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")

# what npu_pool does in place of each setting of torch's (or torch_npu's) caching allocator
INSTEAD: dict[str, str] = {
    "expandable_segments": "npu_pool's arena maps pages on demand already",
    "max_split_size_mb": "npu_pool places by best fit over holes, with no split limit",
    "garbage_collection_threshold": "npu_pool unmaps free pages only under its cap (NPU_POOL_FRACTION)",
    "roundup_power2_divisions": "npu_pool rounds every size to 512 bytes",
    "roundup_bypass_threshold_mb": "npu_pool rounds every size to 512 bytes",
    "per_process_memory_fraction": "use NPU_POOL_FRACTION",
    "backend": "npu_pool is the allocator",
    "page_size": "npu_pool maps 2 MiB pages",
    "segment_size_mb": "npu_pool has one arena per device, no segments",
    "pinned_use_host_register": "host memory is torch's, untouched",
    "pinned_use_cuda_host_register": "host memory is torch's, untouched",
    "pinned_num_register_threads": "host memory is torch's, untouched",
    "release_lock_on_cudamalloc": "npu_pool takes its own lock",
}
_OTHER = "not an npu_pool setting"
_MAX_ENTRIES = 32  # a hostile value cannot make the line unbounded


def _entries(value: str) -> list[tuple[str, str]]:
    out = []
    for item in value.split(",")[:_MAX_ENTRIES]:
        key, _, val = item.strip().partition(":")
        if key.strip():
            out.append((key.strip()[:64], val.strip()[:64]))
    return out


def ignored_message(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """One line naming each torch allocator setting in the environment and what npu_pool
    does instead; None when none is set."""
    env = os.environ if environ is None else environ
    parts = []
    for var in VARIABLES:
        value = env.get(var, "").strip()
        if not value:
            continue
        described = [f"{k}{':' + v if v else ''} ({INSTEAD.get(k, _OTHER)})" for k, v in _entries(value)]
        parts.append(f"{var}: " + ", ".join(described or [repr(value[:64])]))
    if not parts:
        return None
    return "npu_pool is the allocator, so torch's allocator settings are ignored: " + "; ".join(parts)


def warn_ignored(environ: Optional[Mapping[str, str]] = None) -> None:
    """Warn (one line) about the settings :func:`ignored_message` finds."""
    message = ignored_message(environ)
    if message:
        import warnings

        warnings.warn(message, RuntimeWarning, stacklevel=3)
