"""Files the tools read are regular files.

A FIFO, a device, a socket or a directory named where a trace, snapshot, plan, config or rank
report is expected would block at open() (a FIFO without a writer), never end (``/dev/zero``)
or fail half-way. :func:`open_regular` opens without blocking, checks what the path is, and
refuses anything but a regular file with :class:`NotRegularFile`, naming it; every reader
uses it (the mirror of :mod:`npu_pool.outputs` for writers).

Pure Python, imports nothing of the package.
"""
from __future__ import annotations

import os
import stat
from typing import BinaryIO

__all__ = ["open_regular", "NotRegularFile", "kind_of"]

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


class NotRegularFile(OSError):
    """``path`` names something other than a regular file; ``kind`` says what (``kind_of``)."""

    def __init__(self, path: str | os.PathLike[str], kind: str):
        super().__init__(f"{os.fspath(path)}: not a regular file ({kind})")
        self.kind = kind


def kind_of(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words ("a FIFO", "a directory", ...)."""
    return next((name for test, name in _KINDS if test(mode)), "not a file")


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """``path`` opened for binary reading. The open never blocks (a FIFO without a writer is
    refused, not waited on); :class:`NotRegularFile` unless it is a regular file (or a link to
    one), any other ``OSError`` when it cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(path, kind_of(mode))
        return os.fdopen(fd, "rb")  # O_NONBLOCK changes nothing for a regular file's reads
    except BaseException:
        os.close(fd)
        raise
