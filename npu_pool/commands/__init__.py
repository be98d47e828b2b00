"""Sub-commands of the ``npu-pool`` CLI (see npu_pool/cli.py)."""
from __future__ import annotations

import argparse
from typing import Callable


def whole(minimum: int = 1) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``minimum`` (argparse then says which option
    got what, in one line, instead of the value failing deep inside a model as a traceback)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, not {v}")
        return v

    parse.__name__ = "whole number"  # argparse names the type in its own messages
    return parse
