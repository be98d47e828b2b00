"""Files the tools write are whole or absent.

Every output (traces, snapshots, plans, reports, OOM snapshots) goes through :func:`output`:
the bytes are written to a hidden partial file in the destination's folder
(``.<name>.partial``), flushed and synced, then renamed over the destination. A failure of
any kind (disk full, a bad value half-way, Ctrl-C, SIGTERM in the main thread) removes the
partial file and leaves the destination as it was. The partial file is also a lock: a
second writer of the same destination, in this process or another, is refused with
:class:`OutputBusy` while the first is writing (two writers never interleave; the last
to finish wins). A destination that exists and is not a regular file (a FIFO, a terminal, a
device, ``/dev/stdout``) cannot be replaced: it is written directly, as a shell's ``>`` would; a
symbolic link is followed, the file it names replaced and the link kept. Checks registered with
:func:`guard` run before a destination is replaced (the command line's: not one of its inputs).

Pure Python, imports nothing of the package.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import io
import os
import re
import signal
import stat
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Callable, Iterator

__all__ = ["output", "check", "write_bytes", "write_text", "OutputBusy", "partial_path", "guard"]

PARTIAL = ".partial"
_NAME_MAX = 255  # bytes in a file name (Linux, and the file systems it mounts)
_GUARDS: list[Callable[[Path], None]] = []


def guard(check: Callable[[Path], None]) -> None:
    """Run ``check(destination)`` before every later output replaces a file; it raises (an
    ``OSError``) to refuse the destination. A check registered twice runs once."""
    if check not in _GUARDS:
        _GUARDS.append(check)


class OutputBusy(OSError):
    """Another writer holds the destination."""


def partial_path(path: str | os.PathLike[str]) -> Path:
    """The hidden file a write of ``path`` goes to before it is renamed into place: ``.NAME.partial``,
    or for a name too long to take those 9 bytes more (a file name holds 255), ``.`` and a digest
    of the name (the same for every writer of ``path``: it is also their lock)."""
    p = Path(path)
    part = f".{p.name}{PARTIAL}"
    if len(os.fsencode(part)) > _NAME_MAX:
        part = f".{hashlib.sha256(os.fsencode(p.name)).hexdigest()[:32]}{PARTIAL}"
    return p.with_name(part)


def _fail(path: Path, e: OSError, what: str = "cannot write") -> OSError:
    reason = e.strerror or str(e)
    return OSError(e.errno, f"{path}: {what} ({reason}); nothing was written")


def _claim(path: Path) -> int:
    """Open and lock the partial file of ``path``; its descriptor. OutputBusy when held."""
    part = partial_path(path)
    for _ in range(8):  # a finished writer may rename the file we opened: open again
        try:
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as e:  # (the file itself may be there, in a folder that takes no new file: /proc)
            there = path.parent.is_dir() and os.path.lexists(path)
            where = f"cannot write a file beside it in {path.parent}" if there else "cannot write"
            raise _fail(path, e, where) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise OutputBusy(errno.EBUSY, f"{path}: another process is writing it right now; "
                                 "not overwritten (try again when it is done)") from None
            raise _fail(path, e) from None
        try:
            same = os.stat(part).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            return fd
        os.close(fd)  # locked an inode that is no longer the partial file
    raise OutputBusy(errno.EBUSY, f"{path}: other processes keep writing it; not overwritten")


class _Term(BaseException):
    """SIGTERM while an output was being written (raised in the main thread only)."""


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    """In the main thread, turn a default SIGTERM into an exception for the duration, so the
    partial file is removed; elsewhere (or with a handler installed) change nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        old = signal.getsignal(signal.SIGTERM)
    except (ValueError, OSError):
        old = None
    if old is not signal.SIG_DFL:
        yield
        return

    def raise_term(signum: int, frame: Any) -> None:
        raise _Term()

    signal.signal(signal.SIGTERM, raise_term)
    try:
        yield
    except _Term:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # die as the signal asked, the output already cleaned up
        raise
    finally:
        signal.signal(signal.SIGTERM, old)


# A file name the file system gave as bytes that are not UTF-8 (os.fsdecode's lone surrogates) is
# written as an escape ("\udcff"), so that a text output stays UTF-8, instead of failing whole.
_ERRORS = "backslashreplace"


_STREAM = re.compile(r"/+(dev/(stdout|stderr|fd/\d+)|proc/(self|thread-self|\d+)(/task/\d+)?/fd/\d+)")


def _destination(path: str | os.PathLike[str]) -> tuple[Path, bool]:
    """The file a write of ``path`` replaces (a link followed), the guards run; and whether it is
    special (written directly). Raises for a destination no write can take."""
    if os.fspath(path) == "-":  # (it would be a file named '-' in the current folder)
        raise ValueError("an output named '-': name a file; standard output is not written through this option")
    p = Path(path)
    # /dev/stdout, /proc/self/fd/1, ...: a stream's file, which a rename would replace (the lines
    # written before it lost) and the stream would no longer reach; not every file under /dev
    # (/dev/shm's are files of a file system like any other: replaced whole, never an input)
    stream = _STREAM.fullmatch(os.path.abspath(p)) is not None
    try:
        if p.is_dir():
            raise IsADirectoryError(errno.EISDIR, f"{p}: is a directory; name a file to write")
        try:
            mode = os.stat(p).st_mode
            if stat.S_ISSOCK(mode):
                raise OSError(errno.EINVAL, f"{p}: is a socket; name a file to write")
            if not stat.S_ISREG(mode) or stream:
                return p, True
        except FileNotFoundError:
            pass  # absent (or a dangling link): created
        if p.is_symlink():
            p = Path(os.path.realpath(p))  # the file the link names is replaced; the link stays
    except OSError as e:  # (a loop of links, a name too long, a folder that cannot be searched, ...)
        if e.filename is None:
            raise
        raise _fail(p, e) from None
    for check in _GUARDS:
        check(p)
    return p, False


def check(path: str | os.PathLike[str]) -> None:
    """Raise now what :func:`output` would raise for ``path`` before writing a byte (a folder, a
    socket, a missing or unwritable folder, a name too long, a loop of links, one of the
    command's inputs), for a command that works a long time before it writes. Leaves nothing
    behind. A FIFO or a device is vouched for only when written (opening a FIFO to find out
    whether anyone reads it would end the reader's input)."""
    p, special = _destination(path)
    if not special:
        fd = _claim(p)
        try:
            os.unlink(partial_path(p))
        finally:
            os.close(fd)


@contextmanager
def output(path: str | os.PathLike[str], mode: str = "wb", *, encoding: str = "utf-8") -> Iterator[IO[Any]]:
    """Open ``path`` for writing whole-or-nothing (``mode`` ``"wb"`` or ``"w"``). The
    destination appears, complete, only when the ``with`` block ends without an exception."""
    if mode not in ("wb", "w"):
        raise ValueError(f"output mode {mode!r}: use 'wb' or 'w'")
    p, special = _destination(path)
    if special:
        with _direct(p, mode, encoding) as f:
            yield f
        return
    with _sigterm_raises():
        fd = _claim(p)
        part = partial_path(p)
        raw = os.fdopen(fd, "wb", closefd=True)
        f: IO[Any] = raw if mode == "wb" else io.TextIOWrapper(raw, encoding=encoding, errors=_ERRORS, newline="")
        done = False
        try:
            try:
                yield f
                f.flush()
                os.fsync(raw.fileno())
            except OSError as e:
                if isinstance(e, OutputBusy) or e.filename is not None:  # not this file's: another file's error
                    raise
                raise _fail(p, e) from None
            try:
                os.replace(part, p)
            except OSError as e:
                raise _fail(p, e, "cannot rename into place") from None
            done = True
        finally:
            if not done:
                try:
                    os.unlink(part)  # still locked by us: no other writer uses this name now
                except OSError:
                    pass
            try:
                f.close()  # releases the lock
            except OSError:
                pass


@contextmanager
def _direct(p: Path, mode: str, encoding: str) -> Iterator[IO[Any]]:
    """Write straight into ``p``, which exists and is not a regular file, or is one reached as a
    stream (/dev/stdout): it cannot be replaced whole. A regular file is appended to, after what
    this process printed (a shell's > opened it once, for both). A FIFO nobody reads is refused
    instead of waited on."""
    try:
        regular = stat.S_ISREG(os.stat(p).st_mode)
        if regular:
            for stream in (sys.stdout, sys.stderr):
                if stream is not None:
                    stream.flush()
        fd = os.open(p, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_APPEND if regular else 0))
        os.set_blocking(fd, True)
    except OSError as e:
        if e.errno == errno.ENXIO:
            raise OSError(e.errno, f"{p}: a FIFO nobody reads; nothing was written") from None
        raise _fail(p, e) from None
    raw = os.fdopen(fd, "wb", closefd=True)
    f: IO[Any] = raw if mode == "wb" else io.TextIOWrapper(raw, encoding=encoding, errors=_ERRORS, newline="")
    try:
        yield f
        f.flush()
    except OSError as e:
        if isinstance(e, OutputBusy) or e.filename is not None:
            raise
        raise OSError(e.errno, f"{p}: cannot write ({e.strerror or e}); what was written so far stays there") from None
    finally:
        try:
            f.close()
        except OSError:
            pass


def write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` whole or not at all."""
    with output(path, "wb") as f:
        f.write(data)
    return Path(path)


def write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` whole or not at all."""
    with output(path, "w") as f:
        f.write(text)
    return Path(path)
