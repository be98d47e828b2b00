"""Reading a pickled ``{key: value, ...}`` dict piece by piece, one of its values being a list
of lists whose items are handed over a few at a time: memory stays bounded by the pieces and
by what the file really shares, not by the whole object tree.

Why not ``pickle.load`` of the whole file: its memo keeps every object the pickler memoized
alive to the end, and the pickler memoizes every dict and list -- each PyTorch TraceEntry and
its frame list -- though almost none is referenced again (what is shared are the frame dicts
and the key strings). So the whole tree, 3-9x the file, lives until the load returns.

Two passes over the opcodes:

1. :class:`_Scan` walks the opcode stream (a pickletools-like walk; among the listed items,
   the bulk of a snapshot, runs of common opcodes are matched by one regular expression, in
   C, and only marks, closers and memo stores come back to Python). It follows the structure
   only at the top: the dict, the list of lists named ``key`` and its lists' items; everything
   inside an item or another value is stepped over, counting marks. It cuts the file into
   ranges (the dict's keys and values, runs of whole items of a listed list of about
   :data:`_PIECE` bytes), notes where each memo store is, and for each memo index the last
   range that reads it (a memo read names its index; where a file stores an index again, the
   later store replaces the earlier object in the memo anyway).
2. :func:`stream_dict` feeds those ranges, in file order and as written, to one C unpickler
   (whose memo carries over from range to range, so shared objects are the same objects as in
   a whole load), each range wrapped as a small pickle of a list. After each range, the memo
   indices it stored that nothing reads, and those it read for the last time, are set to None
   by a small pickle of LONG_BINPUT opcodes: the objects are freed as soon as the consumer
   drops them, and only what later ranges read stays.

Anything outside that shape or outside plain data -- a global, a persistent id, an opcode
the scan does not know, a truncated file, a structure it cannot follow exactly, a memo store
on the dict or on the listed lists that is read back -- raises :class:`NotStreamable` before
the offending range is unpickled; the caller then reads the file whole as before, which gives
that file's own answer and message. The scan never executes anything and never allocates
more than it has read.
"""
from __future__ import annotations

import pickle
import pickletools
import re
import sys
from array import array
from bisect import bisect_left
from itertools import chain, islice, repeat
from typing import Any, BinaryIO, Callable

__all__ = ["stream_dict", "NotStreamable", "overreach"]

_PIECE = 32 << 10  # bytes of list items unpickled at a time: the memory the reader needs beyond one item
_CHUNK = 256 << 10  # bytes read from the file at a time by the scan
_MARGIN = 512  # bytes the scan keeps ahead of its position (a fixed-size opcode or a short string)
_PENDING = 4096  # distinct runs of memo reads gathered before they are folded into indices
_MAX_SHALLOW = 1 << 16  # entries of the followed structure on the stack (a pickler writes batches of 1000)
_DEAD_PIECE = 1 << 14  # memo indices set to None by one small pickle
# An explicit memo store (PUT, BINPUT, LONG_BINPUT) may name an index at most this far beyond the
# stores before it (a pickler numbers its stores from 0; several picklers' parts reuse indices).
# The C unpickler sizes its memo to twice the index, 8 bytes an entry, zeroed: unbounded, a
# 5-byte LONG_BINPUT of 2^30 would take 16 GB.
_MEMO_SLACK = 1 << 16

# Among the items of a followed list (the bulk of a snapshot) the walk is one regular
# expression: runs of opcodes that push plain objects (memo reads, numbers, short strings, empty
# containers) and of marks filled with them and closed by APPENDS or SETITEMS (a frame list of
# memo reads: no depth change, nothing new) are stepped over in C (possessive: the opcodes are
# told apart by their first byte, so no backtracking is ever needed); only marks, closers, memo
# stores and the opcodes that combine objects come back to Python, one by one. A second
# expression gathers the memo reads of what was stepped over, as runs of consecutive reads.
_PUSHES = (rb"K.|M..|J....|G.{8}|\x8a(?:\x00|\x01.|\x02.{2}|\x03.{3}|\x04.{4}|\x05.{5}|\x06.{6}|\x07.{7}|\x08.{8})"
           rb"|[N\x88\x89}\])\x8f]|\x8c(?:" + b"|".join(re.escape(bytes((n,))) + b"." * n for n in range(256)) + rb")"
           rb"|X(?:" + b"|".join(re.escape(bytes((n,))) + rb"\x00\x00\x00" + b"." * n for n in range(256)) + rb")")
_READS = rb"h.|j...."  # BINGET, LONG_BINGET
_STRUCT = rb"[(eu\x90tld\x911\x94as\x85\x86\x8702]|q.|r...."
_ITEMS = re.compile(rb"(?:" + _READS + rb"|" + _PUSHES + rb"|\((?:" + _READS + rb"|" + _PUSHES + rb")*+[eu])*+(?:("
                    + _STRUCT + rb")|(.)|\Z)", re.S).finditer
_GET_RUNS = re.compile(rb"(?:" + _PUSHES + rb"|" + _STRUCT + rb")*+((?:" + _READS + rb")*+)", re.S).findall
_GET_TOKENS = re.compile(rb"h(.)|j(....)", re.S).findall
# Runs of opcodes that change nothing the scan follows inside an item or a value: the above, and
# TUPLE1-3, APPEND, SETITEM, DUP. The same alternation with memo reads captured lists them.
_SIMPLE = _PUSHES + rb"|[\x85\x86\x87as2]"
_RUN = re.compile(rb"(?:" + _READS + rb"|" + _SIMPLE + rb")*+", re.S).match
_GETS = re.compile(rb"(" + _READS + rb")|" + _SIMPLE, re.S).findall
_PUSH_OPS = frozenset(b"KMJG\x8aN\x88\x89}])\x8fhjgFILSVTUBC\x8e\x8c\x58\x8d\x96\x8b")  # opcodes that push an object

# opcodes
_MARK, _STOP, _POP, _POP_MARK, _DUP = 0x28, 0x2E, 0x30, 0x31, 0x32
_APPEND, _APPENDS, _SETITEM, _SETITEMS = 0x61, 0x65, 0x73, 0x75
_EMPTY_DICT, _EMPTY_LIST = 0x7D, 0x5D
_MEMOIZE, _BINPUT, _LONG_BINPUT, _PUT = 0x94, 0x71, 0x72, 0x70
_BINGET, _LONG_BINGET, _GET = 0x68, 0x6A, 0x67
_PROTO, _FRAME, _TUPLE1 = 0x80, 0x95, 0x85
_SHORT_BINUNICODE, _BINUNICODE, _BINUNICODE8 = 0x8C, 0x58, 0x8D
_STRINGS = (_SHORT_BINUNICODE, _BINUNICODE, _BINUNICODE8)
_CLOSERS = frozenset(b"eu\x90tld\x911")  # APPENDS SETITEMS ADDITEMS TUPLE LIST DICT FROZENSET POP_MARK
_NEW_ITEM = frozenset(b"tld\x91")  # closers that push a new object (the others fill the one below the mark)
_FIXED = {o: n for ops, n in ((b"N\x88\x89}])\x8f\x85\x86\x87as2", 0), (b"Khq", 1), (b"M", 2), (b"Jjr", 4),
                              (b"G", 8)) for o in ops}
_LINE = frozenset(b"FILSV")  # FLOAT INT LONG STRING UNICODE: an argument up to a newline
_SIZED = {0x8A: (1, False), 0x8B: (4, True), 0x54: (4, True), 0x55: (1, False), 0x42: (4, False), 0x43: (1, False),
          0x8E: (8, False), 0x8C: (1, False), 0x58: (4, False), 0x8D: (8, False), 0x96: (8, False)}
# LONG1 LONG4 BINSTRING SHORT_BINSTRING BINBYTES SHORT_BINBYTES BINBYTES8 SHORT_BINUNICODE BINUNICODE
# BINUNICODE8 BYTEARRAY8: (length bytes, signed); everything else (globals, REDUCE, BUILD, persistent
# ids, out-of-band buffers, EXT*) is not plain data: NotStreamable.

# roles of the entries of the followed structure: the dict, a key, a value, the followed list,
# one of its lists, an item of those, a part of a value or item not yet merged into it, a mark
_D, _K, _V, _T, _L, _E, _X, _M = range(8)


class NotStreamable(Exception):
    """The file is not in the shape the streamed reader follows (or not a valid pickle): read it whole."""


def _read_on(f: BinaryIO, size: int, held: int) -> bytes:
    """The next piece of ``f`` (at most _CHUNK bytes) after the ``held`` bytes read so far, never
    past ``size``: the file's size when opened (what a file grown since holds is not read, as in
    the whole read)."""
    return f.read(max(0, min(_CHUNK, size - held)))


class _Scan:
    """Pass 1: the memo stores never read back, the FRAME opcodes, and the ranges to unpickle."""

    def __init__(self, f: BinaryIO, size: int, key: str, read: Callable[[int], None] = lambda _n: None) -> None:
        self.f, self.size, self.key, self.read = f, size, key, read  # read(bytes): how far the scan has read
        self.buf, self.base, self.i = b"", 0, 0
        self.stores = array("I" if size < 1 << 32 else "Q")  # file position of each memo store, in order
        self.memo_len = 0  # MEMOIZE opcodes so far: the index the next one stores at
        self.put = False  # whether the file stores with explicit indices (PUT, BINPUT, LONG_BINPUT)
        self.pending: set[bytes] = set()  # runs of BINGET/LONG_BINGET opcodes met since the last fold
        self.last = array("I")  # memo index -> 1 + the range after which no memo read names it (0: none does)
        self.frames = array("Q")  # positions of FRAME opcodes (left out of the ranges)
        self.frame_end = 0  # where the latest frame ends: the next may begin there, not before
        # the ranges, in file order: role, start, end, number of items
        self.roles, self.starts, self.ends, self.counts = array("B"), array("Q"), array("Q"), array("Q")
        self.structural: list[int] = []  # stores made on the dict and the listed lists (must not be read back)
        self.stack: list[list] = []  # [role, start, key name]: the followed structure
        self.deep = 0  # marks open inside an item or a value
        self.deep_mark = 0
        self.open: list | None = None  # [role, start, count]: the range being gathered
        self.seen_key = False

    # -- input ------------------------------------------------------------------------------

    def _refill(self) -> bool:
        """Keep _MARGIN bytes ahead of the position when the file has them; False at its end (its
        size when opened: what a file grown since holds is not read, as in the whole read)."""
        more = _read_on(self.f, self.size, self.base + len(self.buf))
        self.read(self.base + len(self.buf) + len(more))
        self.base += self.i
        self.buf = self.buf[self.i:] + more
        self.i = 0
        return bool(more)

    def _need(self, n: int) -> None:
        """Make the n bytes from the position available (a longer argument is read on demand)."""
        while len(self.buf) - self.i < n:
            if self.base + self.i + n > self.size or not self._refill():
                raise NotStreamable("truncated")

    def _skip(self, n: int) -> None:
        """Step over n bytes, reading past the ones not needed."""
        if self.base + self.i + n > self.size:
            raise NotStreamable("truncated")
        if self.i + n <= len(self.buf):
            self.i += n
            return
        target = self.base + self.i + n
        self.f.seek(target)
        self.buf, self.base, self.i = b"", target, 0

    # -- the memo ---------------------------------------------------------------------------

    def _store(self, pos: int, idx: int | None, structural: bool = False) -> None:
        """A memo store at ``pos``: MEMOIZE (``idx`` None, at the memo's length) or an explicit index.
        A file mixing the two (no pickler writes one) is read whole: the memo's length would need
        every index stored so far."""
        if idx is None:
            if self.put:
                raise NotStreamable("memo")
            idx = self.memo_len
            self.memo_len += 1
        elif self.memo_len:
            raise NotStreamable("memo")
        elif idx > len(self.stores) + _MEMO_SLACK:
            raise NotStreamable("memo index")  # (read whole, overreach refuses it first)
        else:
            self.put = True
        self.stores.append(pos)
        if structural:
            self.structural.append(idx)

    def _fold(self) -> None:
        """The memo reads gathered so far, into ``read``: each is in a range before the one being
        gathered, or in it; it counts as read up to the end of that one (never too early). Inside
        an item begun by a mark (``deep``) the range may yet be cut at that mark, when a closer
        makes the item (TUPLE, LIST, DICT): the reads after the mark then lie in the next range."""
        last, arr = len(self.roles) + 1 + (self.deep > 0), self.last
        for short, long in set(_GET_TOKENS(b"".join(self.pending))):
            idx = short[0] if short else int.from_bytes(long, "little")
            if idx < len(arr):
                arr[idx] = last
            else:
                self._read(idx, last)
        self.pending.clear()

    def _read(self, idx: int, last: int) -> None:
        if idx >= len(self.last):
            if idx > 4 * len(self.stores) + 4096:  # a read of nothing: the unpickler fails on it
                raise NotStreamable("memo index")
            self.last.extend(array("I", bytes(4 * (idx + 1 - len(self.last)))))
        self.last[idx] = last

    def read_indices(self) -> array:
        """Memo index -> 1 + the last range that reads it (0: never read). A store is kept when its
        index is read, and freed after the last range that reads the index. Where an index is
        stored again (a file written by several picklers, as npu_pool's export is), the later store
        frees the earlier object in the unpickler's memo anyway, so this bound is cheap and safe."""
        self._fold()
        return self.last

    def _line(self) -> bytes:
        """The argument of a text opcode at the position (up to its newline); steps past it. A line
        longer than the buffer is gathered piece by piece (refilling would copy it whole each
        time: a line of 32 MB took 2 s, quadratic in its length)."""
        j = self.buf.find(b"\n", self.i + 1)
        if j >= 0:
            arg = self.buf[self.i + 1:j]
            self.i = j + 1
            return arg
        parts = [self.buf[self.i + 1:]]
        while True:
            more = _read_on(self.f, self.size, self.base + len(self.buf))
            if not more:
                raise NotStreamable("truncated")
            self.base, self.buf, self.i = self.base + len(self.buf), more, 0
            j = more.find(b"\n")
            if j >= 0:
                parts.append(more[:j])
                self.i = j + 1
                return b"".join(parts)
            parts.append(more)

    def _text_memo(self, op: int, pos: int) -> None:
        arg = self._line()
        if not re.fullmatch(rb"0|[1-9][0-9]{0,17}", arg):
            raise NotStreamable("memo index")
        idx = int(arg)
        if op == _PUT:
            self._store(pos, idx)
        elif idx >= 1 << 32:
            raise NotStreamable("memo index")
        else:  # gathered with the binary reads: in which range it lies is known when they are folded
            self.pending.add(b"j" + idx.to_bytes(4, "little"))

    # -- the walk ---------------------------------------------------------------------------

    def run(self) -> None:
        self._refill()
        while True:
            items = self._at_items()
            if items:
                self._items()
            if self.deep:
                self._deep(items)
            elif self._shallow():
                break

    def _at_items(self) -> bool:
        """Whether the position is among the items of a batch of a followed list (or inside one)."""
        st = self.stack
        if len(st) < 3:
            return False
        if st[-1][0] == _E:
            return st[-2][0] == _M and st[-3][0] == _L
        return st[-1][0] == _M and st[-2][0] == _L

    def _items(self) -> None:
        """The fast walk among the items of a batch (see _ITEMS). An item begins where an opcode
        that pushes follows a closed mark or a store at the batch's level: the ranges are cut
        there. Stops before an opcode the expression does not take (the slow walk takes it) and
        before the closer of the batch."""
        d = self.deep
        o = self.open
        if len(self.buf) - self.i < _MARGIN:
            self._refill()
        if self.i >= len(self.buf):
            return
        if d == 0 and (o is None or o[0] != _E):  # the batch's first item
            if self.buf[self.i] not in _PUSH_OPS:
                return
            self._push(self.base + self.i, self.buf[self.i])
        elif o is None or o[0] != _E:
            raise NotStreamable("structure")
        pending, stores = self.pending, self.stores
        while True:
            buf, i, base = self.buf, self.i, self.base
            stop = len(buf)
            for m in _ITEMS(buf, i):
                k = m.start(1)
                if k < 0:
                    stop = m.start(2) if m.start(2) >= 0 else m.end()
                    break
                op = buf[k]
                if op == _MARK:
                    if d == 0:
                        self.deep_mark = base + k
                    d += 1
                    continue
                if op in _CLOSERS:
                    if d == 0:  # the batch's own closer: the slow walk takes it
                        pending.update(_GET_RUNS(buf, i, k))
                        self.i, self.deep = k, 0
                        return
                    d -= 1
                    if d:
                        continue
                    if op in _NEW_ITEM:  # a new item, begun at its mark
                        self._cut(self.deep_mark)
                    elif op == _POP_MARK:
                        raise NotStreamable("structure")
                elif op == _MEMOIZE or op == _BINPUT or op == _LONG_BINPUT:
                    if self.put if op == _MEMOIZE else self.memo_len:
                        raise NotStreamable("memo")  # MEMOIZE mixed with explicit indices (as _store)
                    if op == _MEMOIZE:
                        self.memo_len += 1
                    elif op == _LONG_BINPUT and int.from_bytes(buf[k + 1:k + 5], "little") > len(stores) + _MEMO_SLACK:
                        raise NotStreamable("memo index")  # (as _store)
                    else:
                        self.put = True
                    stores.append(base + k)
                    if d:
                        continue
                elif op == _POP or (d == 0 and op != _TUPLE1):
                    raise NotStreamable("structure")  # items combined, or a mark popped: not followed
                elif d:
                    continue
                after = m.end(1)
                if after < len(buf) and buf[after] in _PUSH_OPS:  # at the batch's level: an item begins
                    self._cut(base + after)
            pending.update(_GET_RUNS(buf, i, stop))
            self.i, self.deep = stop, d  # (before the fold: the reads of an open item may move to the next range)
            if len(pending) > _PENDING:
                self._fold()
            if len(buf) - stop >= _MARGIN or not self._refill():
                return

    def _cut(self, pos: int) -> None:
        """An item begins at ``pos`` in the range being gathered: end the range there when long."""
        o = self.open
        if pos - o[1] >= _PIECE:
            self.deep = 0  # (at the batch's level: no item is open for the fold)
            self._flush(pos)
            self.open = [_E, pos, 0]

    def _op(self) -> tuple[int, int]:
        """The next opcode and its file position, keeping _MARGIN bytes ahead."""
        if len(self.buf) - self.i < _MARGIN:
            self._refill()
        if self.i >= len(self.buf):
            raise NotStreamable("truncated")
        return self.buf[self.i], self.base + self.i

    def _step(self, op: int, pos: int) -> bool:
        """Step over an opcode that is neither structure nor memo; False when it is not plain data."""
        buf, i = self.buf, self.i
        n = _FIXED.get(op)
        if n is not None:
            self._need(1 + n)
            if op in (_BINGET, _LONG_BINGET):
                self.pending.add(bytes(self.buf[self.i:self.i + 1 + n]))
            self.i += 1 + n
            return True
        sized = _SIZED.get(op)
        if sized is not None:
            width, signed = sized
            self._need(1 + width)
            buf, i = self.buf, self.i
            length = int.from_bytes(buf[i + 1:i + 1 + width], "little", signed=signed)
            if length < 0:
                raise NotStreamable("negative length")
            self.i += 1 + width
            self._skip(length)
            return True
        if op in _LINE:
            self._line()
            return True
        if op == _PROTO:
            self._need(2)
            if self.buf[self.i + 1] > pickle.HIGHEST_PROTOCOL:
                raise NotStreamable("protocol")
            self.i += 2
            return True
        if op == _FRAME:
            self._need(9)
            length = int.from_bytes(self.buf[self.i + 1:self.i + 9], "little")
            if pos + 9 + length > self.size:  # the C unpickler reads a frame whole before using it
                raise NotStreamable("truncated frame")
            if pos < self.frame_end:  # (the unpicklers refuse it; a walk that ignores frames would not)
                raise NotStreamable("a frame begins inside the one before it")
            self.frame_end = pos + 9 + length
            self.frames.append(pos)
            self.i += 9
            return True
        if op in (_GET, _PUT):
            self._text_memo(op, pos)
            return True
        return False

    def _deep(self, one: bool = False) -> None:
        """Inside an item or a value: count marks, note memo stores and reads, until the mark
        that began it is closed (``one``: return after the first opcode outside a run, so that
        the fast walk among items goes on)."""
        run, gets, pending = _RUN, _GETS, self.pending
        while True:
            if len(self.buf) - self.i < _MARGIN:
                self._refill()
            buf, i = self.buf, self.i
            j = run(buf, i).end()
            if j != i:
                pending.update(gets(buf, i, j))
                self.i = i = j
                if len(buf) - i < _MARGIN:
                    continue
            if i >= len(buf):
                raise NotStreamable("truncated")
            op = buf[i]
            pos = self.base + i
            if op == _MEMOIZE:
                self.i += 1
                self._store(pos, None)
            elif op == _MARK:
                self.deep += 1
                self.i += 1
            elif op in _CLOSERS:
                self.i += 1
                self.deep -= 1
                if self.deep == 0:
                    self._closed(op)
                    return
            elif op == _BINPUT:
                self.i += 2
                self._store(pos, buf[i + 1])
            elif op == _LONG_BINPUT:
                self.i += 5
                self._store(pos, int.from_bytes(buf[i + 1:i + 5], "little"))
            elif op == _SHORT_BINUNICODE:
                self.i += 2
                self._skip(buf[i + 1])
            elif not self._step(op, pos):
                raise NotStreamable(f"opcode {op:#x}")
            if one:
                return

    def _closed(self, op: int) -> None:
        """The mark opened inside the top item closed: it filled that item, or made a new one."""
        if op in _NEW_ITEM:
            self._push(self.deep_mark, None)
        elif op == _POP_MARK or not self.stack or self.stack[-1][0] not in (_V, _E, _X) or self.open is None:
            raise NotStreamable("structure")

    # -- the followed structure -------------------------------------------------------------

    def _flush(self, end: int) -> None:
        o = self.open
        if o is not None:
            self.roles.append(o[0])
            self.starts.append(o[1])
            self.ends.append(end)
            self.counts.append(o[2])
            self.open = None
            if self.pending:
                self._fold()

    def _role(self, op: int | None) -> int:
        """The role of an object pushed on top of the followed structure by opcode ``op``."""
        st = self.stack
        if not st:
            return _D
        top = st[-1][0]
        if top == _M:
            return {_D: _K, _T: _L, _L: _E}[st[-2][0]]
        if top == _D:
            return _K
        if top == _K:
            return _T if st[-1][2] == self.key else _V
        if top == _T:
            if op == _EMPTY_LIST:
                return _L  # a list appended alone (its APPEND follows)
            if st[-3][0] != _D:
                return _K  # the next key of a batch
            raise NotStreamable("structure")
        if top == _V:  # the next key of a batch, or a part of the value (a one-item list, a tuple)
            return _K if op in _STRINGS and st[-3][0] != _D else _X
        if top == _X:
            return _X
        if top == _L:
            if op == _EMPTY_LIST and st[-2][0] in (_M, _L):
                return _L  # the next list of a batch
            return _E
        if st[-2][0] == _L:  # a second object over an item appended alone: they would be combined
            raise NotStreamable("structure")
        return _E  # top == _E: the next item of a batch

    def _push(self, pos: int, op: int | None) -> None:
        role = self._role(op)
        name = None
        if role == _K:
            name = self._key(op)
        elif role in (_D, _T, _L) and op != (_EMPTY_DICT if role == _D else _EMPTY_LIST):
            raise NotStreamable("structure")
        o = self.open
        if role == _X:
            if o is None:
                raise NotStreamable("structure")
        elif role == _E and o is not None and o[0] == _E and pos - o[1] < _PIECE:
            o[2] += 1  # one more item of the same list in the range
        else:
            self._flush(pos)
            self.open = [role, pos, 1]
        if role == _E and self.stack and self.stack[-1][0] == _E:
            self.stack[-1][1] = pos  # items are never combined (below): the latest stands for them all
            return
        if len(self.stack) >= _MAX_SHALLOW:
            raise NotStreamable("batch too long")
        self.stack.append([role, pos, name])

    def _merge(self, n: int) -> None:
        """The top ``n`` objects become part of the one below them (APPEND, SETITEM, TUPLE2/3):
        all of them must lie in the range being gathered."""
        st, o = self.stack, self.open
        if len(st) <= n or o is None:
            raise NotStreamable("structure")
        recv = st[-1 - n]
        if recv[0] not in (_V, _X) or recv[1] < o[1] or any(e[0] != _X for e in st[-n:]):
            raise NotStreamable("structure")  # items of a followed list are cut apart: never combined
        del st[-n:]

    def _key(self, op: int | None) -> str:
        """The key a string opcode at the position pushes (only literal strings are followed)."""
        if op == _SHORT_BINUNICODE:
            self._need(2)
            width = 1
        elif op in (_BINUNICODE, _BINUNICODE8):
            width = 4 if op == _BINUNICODE else 8
            self._need(1 + width)
        else:
            raise NotStreamable("key")
        n = int.from_bytes(self.buf[self.i + 1:self.i + 1 + width], "little")
        if n != len(self.key.encode()):
            return ""  # not the followed key: what it is does not matter here
        self._need(1 + width + n)
        raw = self.buf[self.i + 1 + width:self.i + 1 + width + n]
        try:
            name = raw.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            raise NotStreamable("key") from None
        if name == self.key:
            if self.seen_key:
                raise NotStreamable("key twice")
            self.seen_key = True
        return name

    def _shallow(self) -> bool:
        """One opcode of the followed structure; True at its STOP."""
        op, pos = self._op()
        st = self.stack
        if op == _MARK:
            self.i += 1
            if not st:
                raise NotStreamable("structure")
            if st[-1][0] in (_D, _T, _L):
                self._flush(pos)
                st.append([_M, pos, None])
            else:
                self.deep, self.deep_mark = 1, pos
            return False
        if op in _CLOSERS:
            self.i += 1
            self._close_mark(op, pos)
            return False
        if op in (_MEMOIZE, _BINPUT, _LONG_BINPUT, _TUPLE1):
            if not st or st[-1][0] == _M or self.open is None or (op == _TUPLE1 and st[-1][0] not in (_V, _E, _X)):
                raise NotStreamable("structure")
            n = {_MEMOIZE: 0, _BINPUT: 1, _LONG_BINPUT: 4, _TUPLE1: 0}[op]
            self._need(1 + n)
            arg = self.buf[self.i + 1:self.i + 1 + n]
            self.i += 1 + n
            if op != _TUPLE1:
                idx = None if op == _MEMOIZE else int.from_bytes(arg, "little")
                self._store(pos, idx, self.open[0] in (_D, _T, _L))
            return False
        if op == _PUT:
            if not st or st[-1][0] == _M or self.open is None or self.open[0] in (_D, _T, _L):
                raise NotStreamable("structure")
            self._text_memo(op, pos)
            return False
        if op == _APPEND:
            self.i += 1
            if len(st) >= 2 and ((st[-1][0] == _E and st[-2][0] == _L) or (st[-1][0] == _L and st[-2][0] == _T)):
                self._flush(pos)  # an item of a followed list, appended alone
                st.pop()
            else:
                self._merge(1)
            return False
        if op == _SETITEM:
            self.i += 1
            if len(st) >= 3 and st[-3][0] == _D and st[-2][0] == _K and st[-1][0] in (_V, _T):
                self._flush(pos)  # a key of the dict, set alone
                del st[-2:]
            else:
                self._merge(2)
            return False
        if op in (0x86, 0x87):  # TUPLE2 TUPLE3
            self.i += 1
            self._merge(op - 0x85)
            return False
        if op == _STOP:
            if len(st) != 1 or st[0][0] != _D:
                raise NotStreamable("structure")
            self._flush(pos)
            return True
        if op in (_POP, _DUP, _POP_MARK):  # not followed
            raise NotStreamable("structure")
        if op in (_PROTO, _FRAME):
            if not self._step(op, pos):
                raise NotStreamable("structure")
            return False
        # an object pushed: step over its opcode after reading what the role needs
        self._push(pos, op)
        if op == _SHORT_BINUNICODE:
            self._need(2)
            self.i += 2
            self._skip(self.buf[self.i - 1])
        elif not self._step(op, pos):
            raise NotStreamable(f"opcode {op:#x}")
        return False

    def _close_mark(self, op: int, pos: int) -> None:
        """A closer at the followed structure's level: the batch of a mark over the dict or a list."""
        st = self.stack
        k = len(st) - 1
        while k >= 0 and st[k][0] != _M:
            k -= 1
        if k < 1:
            raise NotStreamable("structure")
        owner, items = st[k - 1][0], [e[0] for e in st[k + 1:]]
        if owner == _D:
            ok = op == _SETITEMS and len(items) % 2 == 0 and all(
                r == _K if j % 2 == 0 else r in (_V, _T) for j, r in enumerate(items))
        else:
            ok = op == _APPENDS and all(r == (_L if owner == _T else _E) for r in items)
        if not ok:
            raise NotStreamable("structure")
        self._flush(pos)
        del st[k:]


# opcode -> its argument: n > 0 bytes, or pickletools' codes for a line (-1) and for a length of
# 1 byte, 4 signed, 4 or 8 unsigned (-2 .. -5); GLOBAL and INST take two lines (-6)
_ARGS = {ord(o.code): -6 if o.code in "ci" else o.arg.n if o.arg else 0 for o in pickletools.opcodes}
_LENGTHS = {-2: (1, False), -3: (4, True), -4: (4, False), -5: (8, False)}
_ALLOCATED = {0x42: "BINBYTES", 0x8E: "BINBYTES8", 0x96: "BYTEARRAY8"}  # made at their declared length, then read into


def overreach(f: BinaryIO, size: int) -> str | None:
    """What in the pickle ``f`` (``size`` bytes) would make the C unpickler allocate by a count
    the file does not hold, or None: the first explicit memo store whose index lies more than
    _MEMO_SLACK beyond the stores before it (the memo is sized to twice the index), or the first
    BINBYTES, BINBYTES8 or BYTEARRAY8 longer than the rest of the file (the object is allocated
    at that length before it is read). A walk over every opcode (runs of common ones matched in
    C), for a file read whole. It stops, with None, where the unpickler stops anyway: STOP, the
    file's end, a byte that is no opcode."""
    f.seek(0)
    buf, base, i, stores, more = b"", 0, 0, 0, True
    while True:
        if len(buf) - i < _MARGIN and more:
            more = _read_on(f, size, base + len(buf))
            base, buf, i = base + i, buf[i:] + more, 0
        i = _RUN(buf, i).end()
        if len(buf) - i < _MARGIN and more:
            continue  # (a run up to the buffer's end: the next opcode may be cut)
        if i >= len(buf):
            return None
        op, pos = buf[i], base + i
        n = _ARGS.get(op)
        if n is None or op == _STOP:
            return None
        if op in (_MEMOIZE, _BINPUT):  # (BINPUT: an index below 256)
            stores += 1
            i += 1 + (op == _BINPUT)
            continue
        if op == _LONG_BINPUT or op == _PUT:
            if op == _PUT:  # the whole line, however long: the unpickler takes "  000...0067_108_864"
                parts, i = [], i + 1
                j = buf.find(b"\n", i)
                while j < 0:
                    parts.append(buf[i:])
                    more = _read_on(f, size, base + len(buf))
                    if not more:
                        return None
                    base, buf, i = base + len(buf), more, 0
                    j = buf.find(b"\n")
                parts.append(buf[i:j])
                i = j + 1
                try:
                    idx = int(b"".join(parts))  # (as the unpickler's PyLong_FromString, its digit limit too)
                except ValueError:
                    return None
            else:
                idx = int.from_bytes(buf[i + 1:i + 5], "little")
                i += 5
            if idx > stores + _MEMO_SLACK:
                return (f"a memo store at byte {pos} names index {idx} after {stores} stores: the unpickler would "
                        f"allocate {16 * idx} bytes for it")
            stores += 1
            continue
        if n >= 0:
            i += 1 + n
        elif n in _LENGTHS:
            width, signed = _LENGTHS[n]
            length = int.from_bytes(buf[i + 1:i + 1 + width], "little", signed=signed)
            if length < 0 or pos + 1 + width + length > size:
                if op in _ALLOCATED and length > 0:
                    return (f"a {_ALLOCATED[op]} at byte {pos} declares {length} bytes where {size - pos - 1 - width} "
                            "are left: the unpickler would allocate them before reading")
                return None  # the unpickler fails on it, allocating no more than it reads
            i += 1 + width + length
            if i > len(buf):
                f.seek(base + i)
                base, buf, i, more = base + i, b"", 0, True
        else:
            for _ in range(1 + (n == -6)):  # up to the newline(s), however far
                j = buf.find(b"\n", i + 1)
                while j < 0:
                    more = _read_on(f, size, base + len(buf))
                    if not more:
                        return None
                    base, buf, i = base + len(buf), more, -1
                    j = buf.find(b"\n")
                i = j
            i += 1


# NONE LONG_BINPUT <index> POP NONE as one 8-byte little-endian word: index << 16 plus this
_NONE_OVER = 0x4E | 0x72 << 8 | 0x30 << 48 | 0x4E << 56


def _none_over(indices: list[int]) -> bytes:
    """A pickle that sets each of the memo ``indices`` (below 2^32) to None: NONE LONG_BINPUT POP
    per index (and a None left on the stack each, dropped at the STOP)."""
    words = array("Q", map(_NONE_OVER.__add__, map((1 << 16).__mul__, (i for i in indices if i < 1 << 32))))
    if sys.byteorder == "big":
        words.byteswap()
    return words.tobytes() + b"N."


def _index_at(raw: bytes, j: int) -> int:
    """The memo index of the explicit store at ``raw[j]`` (BINPUT, LONG_BINPUT or PUT)."""
    op = raw[j]
    if op == _BINPUT:
        return raw[j + 1]
    if op == _LONG_BINPUT:
        return int.from_bytes(raw[j + 1:j + 5], "little")
    return int(raw[j + 1:raw.index(b"\n", j)])


class _Feed:
    """The file object of the C unpickler: the current range, whole (``peek`` gives all of it,
    so the unpickler parses it in place)."""

    def __init__(self) -> None:
        self.data = memoryview(b"")
        self.pos = 0

    def set(self, data: bytes) -> None:
        self.data, self.pos = memoryview(data), 0

    def read(self, n: int = -1) -> memoryview:
        end = len(self.data) if n is None or n < 0 else min(len(self.data), self.pos + n)
        out = self.data[self.pos:end]
        self.pos = end
        return out

    def readinto(self, buf: Any) -> int:
        with memoryview(buf) as view, view.cast("B") as target:
            out = self.read(len(target))
            target[:len(out)] = out
            return len(out)

    def readline(self, limit: int = -1) -> bytes:
        rest = self.data[self.pos:].tobytes()
        j = rest.find(b"\n")
        n = len(rest) if j < 0 else j + 1
        if limit is not None and limit >= 0:
            n = min(n, limit)
        self.pos += n
        return rest[:n]

    def peek(self, n: int = 0) -> memoryview:
        return self.data[self.pos:]


def stream_dict(f: BinaryIO, size: int, key: str, unpickler: Callable[[Any], pickle.Unpickler],
                on_list: Callable[[int], None], on_items: Callable[[int, list], None],
                progress: Callable[[int], None] = lambda _n: None) -> dict:
    """Read the pickled dict in ``f`` (``size`` bytes, at its start): the dict of its entries
    other than ``key``, unpickled whole; the lists in the list at ``key`` come through
    ``on_list(i)`` (list ``i`` begins) and ``on_items(i, items)`` (its next items), in order.
    ``unpickler(file)`` makes the unpickler (which must refuse globals). :class:`NotStreamable`
    when the file is not such a dict in a shape this reader follows, when ``key`` is absent,
    or when a range fails to unpickle: read the file whole then. ``progress(n)``: n of the
    2 x ``size`` bytes the two passes read are read (a bar on long files)."""
    scan = _Scan(f, size, key, progress)
    try:
        scan.run()
    except (IndexError, ValueError, OverflowError, KeyError) as e:  # an opcode cut by the file's end
        raise NotStreamable(f"{type(e).__name__}") from None
    last = scan.read_indices()
    n_last = len(last)
    if not scan.seen_key or any(idx < n_last and last[idx] for idx in scan.structural):
        raise NotStreamable("structure")
    stores, frames = scan.stores, scan.frames
    # the memo indices read for the last time in each range, bucketed by range (counting sort)
    first = array("I", bytes(4 * (len(scan.roles) + 2)))
    for v in last:
        first[v] += 1
    first[0] = 0
    total = 0
    for r in range(len(first)):
        first[r], total = total, total + first[r]
    done = array("I", bytes(4 * total))
    fill = array("I", first)
    for idx, v in enumerate(last):
        if v:
            done[fill[v]] = idx
            fill[v] += 1
    del fill
    roles, starts, ends, counts, put = scan.roles, scan.starts, scan.ends, scan.counts, scan.put
    del scan  # the positions of all stores are not needed any more
    feed = _Feed()
    u = unpickler(feed)
    out: dict = {}
    name: Any = None
    lists = -1
    d = fi = 0  # next store, next frame
    n_frames = len(frames)
    for r, (role, start, end, count) in enumerate(zip(roles, starts, ends, counts)):
        progress(size + start)
        f.seek(start)
        raw = f.read(end - start)
        if len(raw) != end - start:
            raise NotStreamable("truncated")
        if d < len(stores) and stores[d] < start:  # a store outside every range would go unmade
            raise NotStreamable("structure")
        d2 = bisect_left(stores, end, d)
        # memo stores of this range that nothing reads: out of the memo once the range is read
        if put:
            stored: Any = array("Q", map(_index_at, repeat(raw), (p - start for p in stores[d:d2])))
        else:
            stored = range(d, d2)  # MEMOIZE: store n, index n
        dead = chain((idx for idx in stored if idx >= n_last or not last[idx]),
                     done[first[r + 1]:first[r + 2]])  # (last[idx] == r + 1)
        d = d2
        parts = [b"]("]  # the range's items become the items of a list
        at = start
        while fi < n_frames and frames[fi] < end:
            p = frames[fi]
            fi += 1
            if p >= start:  # (one between ranges is not unpickled)
                parts.append(raw[at - start:p - start])
                at = p + 9
        parts.append(raw[at - start:])
        parts.append(b"e.")
        feed.set(b"".join(parts))
        del parts, raw
        try:
            objs = u.load()
        except Exception as e:
            raise NotStreamable(f"unpickling: {type(e).__name__}") from None
        if (role != _E and len(objs) != count) or feed.pos != len(feed.data):
            raise NotStreamable("range")
        if role == _E:
            on_items(lists, objs)
        elif role == _K:
            name = objs[0]
        elif role == _V:
            out[name] = objs[0]
        elif role in (_D, _T, _L):
            if objs[0] or type(objs[0]) is not (dict if role == _D else list):
                raise NotStreamable("structure")
            if role == _L:
                lists += 1
                on_list(lists)
        del objs
        # objects no later range reads: out of the memo (a LONG_BINPUT of None over each), a piece
        # at a time (a range of a million MEMOIZEs made a list of its indices: 86x the file)
        while True:
            piece = list(islice(dead, _DEAD_PIECE))
            if not piece:
                break
            feed.set(_none_over(piece))
            u.load()
    return out
