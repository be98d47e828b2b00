"""A stand-in for ``triton`` on a CPU machine with no GPU (tests only).

Megatron-LM imports triton at module level in a few kernel modules
(``batch_invariant_kernels``, inference kernels) that ``megatron.training`` pulls in; the
CPU code paths never launch them. This module lets those imports and decorators run, and any
kernel launch fails loudly: nothing here ever pretends to compute."""
from __future__ import annotations

from typing import Any

__version__ = "0.0.0+npu_pool.stand_in"


class _Kernel:
    """What ``@triton.jit`` / ``@triton.autotune`` make: a kernel that refuses to launch."""

    def __init__(self, fn: Any):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")

    def __getitem__(self, grid: Any) -> "_Kernel":
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"triton stand-in: kernel {self.__name__} cannot run on this machine (no GPU, no triton)")


def _decorator(fn: Any = None, **_kwargs: Any) -> Any:
    if fn is None or not callable(fn):
        return lambda f: _Kernel(f)
    return _Kernel(fn)


jit = _decorator
autotune = lambda *a, **k: (lambda f: _Kernel(f))  # noqa: E731
heuristics = lambda *a, **k: (lambda f: _Kernel(f))  # noqa: E731


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Config:
    def __init__(self, *args: Any, **kwargs: Any):
        self.args, self.kwargs = args, kwargs


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Anything(f"triton.{name}")


class _Anything:
    """Any other attribute: usable in annotations and default arguments, never as a value."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, name: str) -> "_Anything":
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(f"{self._name}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"triton stand-in: {self._name} cannot run on this machine (no GPU, no triton)")

    def __getitem__(self, item: Any) -> "_Anything":
        return self

    def __repr__(self) -> str:
        return f"<triton stand-in {self._name}>"
