"""Placement: an offset for every rectangle (live positions x bytes), keeping the peak low.

Greedy placement: rectangles are taken in an order and each goes to the lowest offset
where it overlaps no time-overlapping rectangle placed before it (the C kernel
``np_plan_place``, csrc/plan.c, with a segment tree over positions holding unions of
used offsets, O(log n) lists per query). The order decides the quality; several are
tried and the lowest peak wins:

- ``size``: largest first (then longest-lived): big tensors pack tightly, small ones
  fill the gaps;
- ``size-class``: power-of-two size classes, largest first, longest-lived first within
  a class: long-lived tensors of similar sizes stack into one band instead of being
  interleaved with short-lived ones of slightly larger sizes;
- ``long-first``: rectangles live for more than half the iteration first (weights'
  gradients, wrapping tensors), then by size.
"""
from __future__ import annotations

import array
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

from . import _native

__all__ = ["ORDERS", "Rects", "Placement", "place"]


class Rects:
    """Rectangles in columns: aligned ``size`` and ``span`` (lo, hi, lo2, hi2 per rectangle:
    live positions [lo, hi) and [lo2, hi2), the second empty unless it wraps)."""

    def __init__(self, n_pos: int):
        self.n_pos = n_pos
        self.size = array.array("Q")
        self.span = array.array("I")

    def add(self, size: int, lo: int, hi: int, lo2: int = 0, hi2: int = 0) -> None:
        self.size.append(size)
        self.span.extend((lo, hi, lo2, hi2))

    def __len__(self) -> int:
        return len(self.size)

    def lengths(self) -> list[int]:
        s = self.span
        return [s[i + 1] - s[i] + s[i + 3] - s[i + 2] for i in range(0, len(s), 4)]


def _by_size(r: Rects, length: list[int]) -> list[int]:
    return sorted(range(len(r)), key=lambda i: (-r.size[i], -length[i], r.span[4 * i]))


def _by_size_class(r: Rects, length: list[int]) -> list[int]:
    return sorted(range(len(r)), key=lambda i: (-r.size[i].bit_length(), -length[i], r.span[4 * i]))


def _long_first(r: Rects, length: list[int]) -> list[int]:
    half = r.n_pos / 2
    return sorted(range(len(r)), key=lambda i: (length[i] <= half, -r.size[i], -length[i], r.span[4 * i]))


ORDERS: dict[str, Callable[[Rects, list[int]], list[int]]] = {
    "size": _by_size, "size-class": _by_size_class, "long-first": _long_first}


@dataclass
class Placement:
    offset: array.array   # per rectangle
    peak: int
    order: str            # the order that gave it


def place(rects: Rects, orders: Sequence[str] = tuple(ORDERS)) -> Placement:
    """Place ``rects`` in each of ``orders``; the placement with the lowest peak (the first of equals).
    The kernel releases the GIL: the orders run on two threads."""
    if not orders:
        raise ValueError("place: no order given")
    length = rects.lengths()

    def one(name: str) -> Placement:
        order = array.array("I", ORDERS[name](rects, length))
        offset, peak = _native.place(rects.n_pos, rects.size, rects.span, order)
        return Placement(offset, peak, name)

    with ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(one, orders))
    return min(done, key=lambda p: p.peak)
