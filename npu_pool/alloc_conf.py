"""torch's allocator settings (``PYTORCH_NPU_ALLOC_CONF``, ``PYTORCH_ALLOC_CONF``,
``PYTORCH_CUDA_ALLOC_CONF``, and the switches ``PYTORCH_NO_NPU_MEMORY_CACHING``,
``PYTORCH_NO_CUDA_MEMORY_CACHING``, ``MULTI_STREAM_MEMORY_REUSE``) once npu_pool is the device
allocator: none of them reaches npu_pool, so :func:`ignored_message` names each one set and what
npu_pool does instead, in one line that ``install()`` warns with. torch (and torch_npu) still read
the ``*_ALLOC_CONF`` variable for pinned host memory, whose settings keep their effect, and refuse
a key they do not know there (at the first ``pin_memory()``), as without npu_pool. Pure Python: no
torch, no core.

The format is torch's: ``key:value`` pairs separated by commas (``expandable_segments:True,
max_split_size_mb:128``; a value in brackets may hold commas: ``roundup_power2_divisions:[256:1,512:2]``).
An entry without a colon is named as it is.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

VARIABLES = ("PYTORCH_NPU_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
# the device caching allocator's switches of their own, and what npu_pool does instead
SWITCHES: dict[str, str] = {
    "PYTORCH_NO_NPU_MEMORY_CACHING": "npu_pool keeps freed memory mapped; empty_cache() or NPU_POOL_FRACTION "
                                     "returns it",
    "PYTORCH_NO_CUDA_MEMORY_CACHING": "npu_pool keeps freed memory mapped; empty_cache() or NPU_POOL_FRACTION "
                                      "returns it",
    "MULTI_STREAM_MEMORY_REUSE": "npu_pool hands memory between streams by events of its own",
}

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
    "base_addr_aligned_kb": "npu_pool aligns every block to 512 bytes",
    "multi_stream_lazy_reclaim": "npu_pool hands memory between streams by events of its own",
    "throw_on_npumalloc_oom": "npu_pool refuses past its cap (NPU_POOL_FRACTION) before any device call",
    "release_lock_on_cudamalloc": "npu_pool takes its own lock",
    "release_lock_on_npumalloc": "npu_pool takes its own lock",
}
# pinned host memory's settings: torch's host allocator still reads them, npu_pool does not touch it
HOST = frozenset({"pinned_use_host_register", "pinned_use_cuda_host_register", "pinned_num_register_threads",
                  "pinned_use_background_threads", "pinned_mem_register", "pin_memory_expandable_segments",
                  "pinned_reserve_segment_size_mb"})
_HOST = "still torch's: pinned host memory"
_OTHER = "not an npu_pool setting"
_MAX_ENTRIES = 32  # a hostile value cannot make the line unbounded
_MAX_SCAN = 8192  # characters of a value looked at (a real one is a few hundred)


def _split(value: str) -> list[str]:
    """The comma-separated items of ``value``, a comma inside brackets kept (at most _MAX_ENTRIES, from
    its first _MAX_SCAN characters)."""
    items, depth, start, value = [], 0, 0, value[:_MAX_SCAN]
    for i, ch in enumerate(value):
        depth += (ch == "[") - (ch == "]" and depth > 0)
        if ch == "," and depth == 0:
            items.append(value[start:i])
            start = i + 1
            if len(items) == _MAX_ENTRIES:
                return items
    return items + [value[start:]]


def _entries(value: str) -> list[tuple[str, str]]:
    out = []
    for item in _split(value):
        key, _, val = item.strip().partition(":")
        if key.strip():
            out.append((key.strip()[:64], val.strip()[:64]))
    return out


def _instead(key: str) -> str:
    return _HOST if key in HOST else INSTEAD.get(key, _OTHER)


def ignored_message(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """One line naming each torch allocator setting in the environment and what npu_pool
    does instead (or that torch still applies it: pinned host memory); None when none is set."""
    env = os.environ if environ is None else environ
    parts = []
    for var in VARIABLES:
        value = env.get(var, "").strip()
        if not value:
            continue
        described = [f"{k}{':' + v if v else ''} ({_instead(k)})" for k, v in _entries(value)]
        parts.append(f"{var}: " + ", ".join(described or [repr(value[:64])]))
    for var, instead in SWITCHES.items():
        value = env.get(var, "").strip()
        if value:
            parts.append(f"{var}={value[:64]} ({instead})")
    if not parts:
        return None
    return ("npu_pool is the device allocator, so torch's device allocator settings do not apply (torch still "
            "reads the variable for pinned host memory, and refuses there a key it does not know): " + "; ".join(parts))


def warn_ignored(environ: Optional[Mapping[str, str]] = None) -> None:
    """Warn (one line) about the settings :func:`ignored_message` finds."""
    message = ignored_message(environ)
    if message:
        import warnings

        warnings.warn(message, RuntimeWarning, stacklevel=3)
