"""Files the tools read are regular files.

A FIFO, a device, a socket or a directory named where a trace, snapshot, plan, config or rank
report is expected would block at open() (a FIFO without a writer), never end (``/dev/zero``)
or fail half-way. :func:`open_regular` opens without blocking, checks what the path is, and
refuses anything but a regular file with :class:`NotRegularFile`, naming it; every reader
uses it (the mirror of :mod:`npu_pool.outputs` for writers). Once :func:`remember` is on (the
command line), :func:`was_read` says whether a file was opened so, whatever name it had then.

Pure Python, imports nothing of the package.
"""
from __future__ import annotations

import os
import stat
from typing import BinaryIO

__all__ = ["open_regular", "NotRegularFile", "kind_of", "remember", "forget", "was_read"]

_READ: set[tuple[int, int]] | None = None  # (device, inode) of the files read, while remembering


def remember() -> None:
    """From now on, note every file :func:`open_regular` opens (for :func:`was_read`), forgetting
    what was noted before (each command of the command line starts afresh)."""
    global _READ
    _READ = set()


def forget() -> None:
    """Stop noting (what was noted is dropped)."""
    global _READ
    _READ = None


def was_read(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a file opened for reading since :func:`remember`."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return _READ is not None and (st.st_dev, st.st_ino) in _READ

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
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(path, kind_of(st.st_mode))
        if _READ is not None:
            _READ.add((st.st_dev, st.st_ino))
        return os.fdopen(fd, "rb")  # O_NONBLOCK changes nothing for a regular file's reads
    except BaseException:
        os.close(fd)
        raise
