"""Planned allocation: trace -> plan -> allocation at planned offsets, with fallback.

Training repeats the same allocation sequence every iteration. ``make_plan`` finds a
steady iteration in a trace and gives every allocation of it an offset in one region
(greedy placement of lifetime x size rectangles, verified overlap-free);
``save_plan``/``load_plan`` write and read plan files; the ``"planned"`` policy (C,
csrc/policy_planned.c) serves requests at their planned offsets and falls back to
the npu_pool policy for the rest. See docs/planner.md.
"""
from __future__ import annotations

from .iteration import Window, find_window
from .make import make_plan
from .plan import ALIGN, NONE, Plan, PlanError
from .planfile import load_plan, save_plan
from .runtime import counts, install, plan_from_env
from .verify import verify

__all__ = ["ALIGN", "NONE", "Plan", "PlanError", "Window", "counts", "find_window", "install", "load_plan",
           "make_plan", "plan_from_env", "save_plan", "verify"]
