"""``triton.language`` of the stand-in (see the package): names exist, nothing computes."""
from __future__ import annotations

from typing import Any

from . import _Anything


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Anything(f"triton.language.{name}")
