"""Sub-commands of the ``npu-pool`` CLI (see npu_pool/cli.py)."""
from __future__ import annotations

import argparse
from typing import Callable


class UsageError(ValueError):
    """A mistake in the command line itself that only the command can see (options that do not go
    together, a policy list naming no policy): the CLI says it in one line and exits 2, as argparse
    does for its own."""


def policy_list(spec: str, *, planned: bool = True) -> list[str]:
    """:func:`npu_pool.replay.policies_from` for a command's ``--policy``: a bad list is a usage error."""
    from ..replay import policies_from

    try:
        return policies_from(spec, planned=planned)
    except ValueError as e:
        raise UsageError(str(e)) from None


def whole(minimum: int = 1, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``minimum`` (and at most ``maximum``; argparse
    then says which option got what, in one line, instead of the value failing deep inside a model
    as a traceback)."""

    def parse(text: str) -> int:
        try:
            if not text.isascii():  # int() takes any script's digits ('٣'); settings are ASCII
                raise ValueError
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, not {text[:40]!r}") from None
        if v < minimum or (maximum is not None and v > maximum):
            bound = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
            raise argparse.ArgumentTypeError(f"must be {bound}, not {str(v)[:40]}")
        return v

    parse.__name__ = "whole number"  # argparse names the type in its own messages
    return parse
