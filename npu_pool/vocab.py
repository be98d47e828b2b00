"""The vocabulary shared with the C core: every code and name below is defined once, in
``npu_pool/csrc/npu_pool.h`` and ``vocab.c``, and read here through the binding.

Trace ops (``OP_*``), tensor categories (``CAT_*``), phase markers (``MARK_*``) and the
stages they open and close, lifetime
classes, replay hints, history event kinds, OOM reasons, plan flags, the 512-byte rounding
of every block and the simulated device's page; the policy registry with each policy's
pools.
"""
from __future__ import annotations

import re
from typing import Optional

from ._core import ffi, lib

__all__ = ["ROUND", "NPU_PAD", "SIM_PAGE", "STREAM_TAGS", "device_stream", "POOLS", "HISTORY_DEFAULT", "HISTORY_MAX", "BACKENDS", "DEVICES", "LIFETIMES", "MARK_NAMES", "OP_NAMES", "CAT_NAMES", "HINTS",
           "EVENT_NAMES", "CALL_NAMES", "CALL_VENDOR", "OOM_REASONS", "STAGE_NAMES", "STAGE_OPENED", "STAGE_CLOSED", "POLICIES", "POOL_NAMES", "POOL_MEANINGS", "POLICY_SUMMARIES",
           "PLAN_AT_ITER_BEGIN", "PLAN_AT_START", "PLAN_MADE_ONCE", "PLAN_FLAGS", "PROFILER_PREFIX", "SITE_FILE", "profiler_label", "profiled_mark",
           "OPTIMIZER_SKIPPED"]


def _names(vocab: int, count: int) -> tuple[str, ...]:
    return tuple(ffi.string(lib.np_vocab_name(vocab, i)).decode() for i in range(count))


def _text(ptr: object) -> str:
    return ffi.string(ptr).decode() if ptr != ffi.NULL else ""


ROUND: int = lib.NP_ROUND          # every block is a multiple of this many bytes
NPU_PAD: int = lib.NP_NPU_PAD      # torch_npu pads each request: round up to this many bytes, add as many
MAX_REQUEST: int = lib.NP_MAX_REQUEST  # larger requests (and capacities) are absurd
SIM_PAGE: int = lib.NP_SIM_PAGE    # the simulated device's mapping page
# The core's tags of free memory, never a caller's stream (refused there): NP_STREAM_ANY (usable
# by every stream; csrc/common.h) and NP_STREAM_MIXED (merged memory of several; csrc/streams.h),
# INTPTR_MIN and INTPTR_MIN + 1, which no enum of the binding can carry.
STREAM_TAGS: tuple[int, int] = (-(1 << 63), -(1 << 63) + 1)


def device_stream(stream: int) -> int:
    """``stream`` as a device stream: the core's tags of free memory are no one stream, the default
    one (0) stands for them (what the snapshots npu_pool writes say, and what it reads of them)."""
    return 0 if stream in STREAM_TAGS else stream
POOLS: int = lib.NP_POOLS          # pools per policy, besides the total
HISTORY_DEFAULT: int = lib.NP_HISTORY_DEFAULT  # history events a pool keeps unless told otherwise
HISTORY_MAX: int = lib.np_history_max()        # the largest history bound the core takes

BACKENDS = _names(lib.NP_VOCAB_BACKEND, lib.NP_BACKEND_COUNT)
LIFETIMES = _names(lib.NP_VOCAB_LIFE, lib.NP_LIFE_COUNT)
DEVICES = _names(lib.NP_VOCAB_DEVICE, lib.NP_DEVICE_COUNT)  # whose request rules: "auto" (the backend's), "npu", "cuda"
MARK_NAMES = _names(lib.NP_VOCAB_MARK, lib.NP_MARK_COUNT)
OP_NAMES = _names(lib.NP_VOCAB_OP, lib.NP_OP_COUNT)
CAT_NAMES = _names(lib.NP_VOCAB_CAT, lib.NP_CAT_COUNT)
HINTS = _names(lib.NP_VOCAB_HINTS, lib.NP_HINTS_COUNT)
EVENT_NAMES = _names(lib.NP_VOCAB_EVENT, lib.NP_EV_COUNT)
OOM_REASONS = _names(lib.NP_VOCAB_OOM, lib.NP_OOM_COUNT)
STAGE_NAMES = _names(lib.NP_VOCAB_STAGE, lib.NP_STAGE_COUNT)  # "outside", "setup", "forward", ...
# device calls by kind (Pool.stats()["calls"]), and the vendor function each kind is ("" where none)
CALL_NAMES = _names(lib.NP_VOCAB_CALL, lib.NP_CALL_COUNT)  # "malloc", "free", "reserve", ...
CALL_VENDOR: dict[str, dict[str, str]] = {
    vendor: {name: _text(lib.np_vocab_name(table, k)) for k, name in enumerate(CALL_NAMES)}
    for vendor, table in (("acl", lib.NP_VOCAB_CALL_ACL), ("cuda", lib.NP_VOCAB_CALL_CUDA))}
# the stage table: begin marker -> the stage it opens; end marker -> the stage it closes
STAGE_OPENED: dict[int, str] = {c: STAGE_NAMES[lib.np_mark_opens(c)] for c in range(lib.NP_MARK_COUNT)
                                if lib.np_mark_opens(c) > lib.NP_STAGE_OUTSIDE}
STAGE_CLOSED: dict[int, str] = {c: STAGE_NAMES[lib.np_mark_closes(c)] for c in range(lib.NP_MARK_COUNT)
                                if lib.np_mark_closes(c) > lib.NP_STAGE_OUTSIDE}

# trace ops
OP_ALLOC, OP_FREE, OP_MARK, OP_EMPTY_CACHE = lib.NP_OP_ALLOC, lib.NP_OP_FREE, lib.NP_OP_MARK, lib.NP_OP_EMPTY_CACHE
OP_SEG_HINT, OP_SEG_FREE, OP_INIT_SEGMENT = lib.NP_OP_SEG_HINT, lib.NP_OP_SEG_FREE, lib.NP_OP_INIT_SEGMENT
OP_INIT_ALLOC, OP_OOM = lib.NP_OP_INIT_ALLOC, lib.NP_OP_OOM
OP_REGION, OP_PAUSE, OP_RESUME = lib.NP_OP_REGION, lib.NP_OP_PAUSE, lib.NP_OP_RESUME
# tensor categories
CAT_UNKNOWN, CAT_PARAMETER, CAT_GRADIENT = lib.NP_CAT_UNKNOWN, lib.NP_CAT_PARAMETER, lib.NP_CAT_GRADIENT
CAT_OPTIMIZER_STATE, CAT_ACTIVATION, CAT_TEMPORARY = lib.NP_CAT_OPTIMIZER_STATE, lib.NP_CAT_ACTIVATION, lib.NP_CAT_TEMPORARY
CAT_INPUT, CAT_AUTOGRAD_DETAIL = lib.NP_CAT_INPUT, lib.NP_CAT_AUTOGRAD_DETAIL
# phase markers
MARK_SETUP_BEGIN, MARK_SETUP_END = lib.NP_MARK_SETUP_BEGIN, lib.NP_MARK_SETUP_END
MARK_ITER_BEGIN, MARK_ITER_END = lib.NP_MARK_ITER_BEGIN, lib.NP_MARK_ITER_END
MARK_FORWARD_BEGIN, MARK_FORWARD_END = lib.NP_MARK_FORWARD_BEGIN, lib.NP_MARK_FORWARD_END
MARK_BACKWARD_BEGIN, MARK_BACKWARD_END = lib.NP_MARK_BACKWARD_BEGIN, lib.NP_MARK_BACKWARD_END
MARK_LAYER_ENTER, MARK_LAYER_EXIT = lib.NP_MARK_LAYER_ENTER, lib.NP_MARK_LAYER_EXIT
MARK_OPTIMIZER_BEGIN, MARK_OPTIMIZER_END = lib.NP_MARK_OPTIMIZER_BEGIN, lib.NP_MARK_OPTIMIZER_END
MARK_EVAL_BEGIN, MARK_EVAL_END = lib.NP_MARK_EVAL_BEGIN, lib.NP_MARK_EVAL_END
OPTIMIZER_SKIPPED = lib.NP_OPTIMIZER_SKIPPED  # optimizer_end's argument for a skipped step (it made no optimizer states)
# lifetime classes, plan flags
LIFE_AUTO, LIFE_LONG, LIFE_SHORT = lib.NP_LIFE_AUTO, lib.NP_LIFE_LONG, lib.NP_LIFE_SHORT
PLAN_AT_ITER_BEGIN, PLAN_AT_START = lib.NP_PLAN_AT_ITER_BEGIN, lib.NP_PLAN_AT_START
PLAN_MADE_ONCE = lib.NP_PLAN_MADE_ONCE
PLAN_FLAGS = PLAN_AT_ITER_BEGIN | PLAN_AT_START | PLAN_MADE_ONCE  # every flag np_set_plan takes

# the policy registry
POLICIES: tuple[str, ...] = tuple(_text(lib.np_policy_name(i)) for i in range(lib.np_policy_count()))
POOL_NAMES: dict[str, tuple[str, ...]] = {
    name: tuple(_text(lib.np_policy_pool_name(i, p)) for p in range(POOLS)) for i, name in enumerate(POLICIES)}
POOL_MEANINGS: dict[str, tuple[str, ...]] = {
    name: tuple(_text(lib.np_policy_pool_meaning(i, p)) for p in range(POOLS)) for i, name in enumerate(POLICIES)}
POLICY_SUMMARIES: dict[str, str] = {name: _text(lib.np_policy_summary(i)) for i, name in enumerate(POLICIES)}

# A marker's name in a torch.profiler trace (and in PyTorch snapshots' external_annotations):
# a record_function range named npu_pool::<marker>::<arg> (npu_pool.recorder.mark_profiled).
PROFILER_PREFIX = "npu_pool::"
# the file of a frame an export writes for a site that is no file:line:function (a captured op path):
# the importer reads its name back as that part of the site
SITE_FILE = "npu_pool-site"
_PROFILED = re.compile(r"^npu_pool::([a-z_]+)::(-?[0-9]{1,19})$")


def profiler_label(code: int, arg: int) -> str:
    """The ``record_function`` name of marker ``code``: ``npu_pool::<marker>::<arg>``."""
    return f"{PROFILER_PREFIX}{MARK_NAMES[code]}::{arg}"


def profiled_mark(name: str) -> Optional[tuple[int, int]]:
    """``(code, arg)`` of a range named by :func:`profiler_label`; None for any other name."""
    m = _PROFILED.match(name)
    arg = int(m.group(2)) if m is not None else 0
    if m is None or m.group(1) not in MARK_NAMES or not -(1 << 63) <= arg < 1 << 63:
        return None  # (an argument a trace's 64-bit column cannot hold names no marker)
    return MARK_NAMES.index(m.group(1)), arg
