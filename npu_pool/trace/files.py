"""Open trace files of any supported kind: npu_pool traces and PyTorch snapshots.

Only regular files are read: a FIFO, a device or a socket (named on the command line, or sitting
in a directory with a trace's suffix) is refused before it is opened for reading, where it would
block forever or never end."""
from __future__ import annotations

from pathlib import Path

from ..inputs import NotRegularFile, open_regular
from .format import MAGIC, PLAN_MAGIC, Trace, TraceError


def open_traces(path: str | Path) -> list[tuple[str, Trace]]:
    """(name, trace) pairs from one file: an ``.npt`` trace, or a snapshot pickle (one per device)."""
    p = Path(path)
    try:
        f = open_regular(p)  # a FIFO without a writer is refused at once, never waited on
    except NotRegularFile as e:
        raise TraceError(f"{p}: not a regular file ({e.kind}); traces are read from files") from None
    except OSError as e:
        raise TraceError(f"{p}: cannot read ({e.strerror})") from None
    with f:
        try:
            head = f.read(len(MAGIC))
        except OSError as e:
            raise TraceError(f"{p}: cannot read ({e.strerror})") from None
    if head == MAGIC or head[:7] == MAGIC[:7] or p.suffix == ".npt":
        return [(p.stem, Trace.load(p))]  # says what is wrong with a trace file
    # every pickle PyTorch writes starts with the protocol opcode; a file named .pickle goes to the
    # snapshot reader whatever it starts with (as `import` reads it: old protocols, or its message)
    if head[:1] != b"\x80" and p.suffix != ".pickle":
        what = ("an npu_pool plan (give it with --plan)" if head == PLAN_MAGIC else
                "empty" if not head else f"neither an npu_pool trace (.npt) nor a PyTorch memory snapshot (.pickle)")
        raise TraceError(f"{p}: {what}")
    from .snapshot import load_snapshot

    traces = load_snapshot(p)
    named = [(p.stem, traces[0])] if len(traces) == 1 else \
        [(f"{p.stem}.dev{t.meta.get('device', i)}", t) for i, t in enumerate(traces)]
    for name, t in named:  # what a snapshot says is held to the rules an .npt file is (Trace.load)
        t.validate(f"{p}" if len(named) == 1 else f"{p} ({name})")
    return named


_REPAIRS_KEPT = 20


def repairs(trace: Trace) -> list[str]:
    """What the snapshot importer repaired in the recording behind ``trace`` (``meta["warnings"]``: a
    block allocated again while live, a free of an unknown block, ...), its first 20."""
    w = trace.meta.get("warnings") if isinstance(trace.meta, dict) else None
    return [str(x) for x in w[:_REPAIRS_KEPT] if isinstance(x, str)] if isinstance(w, list) else []


def repairs_said(fixed: list[str]) -> str:
    """The sentence the reports and replay say of :func:`repairs` (not empty): how many, the first."""
    return (f"the recording was repaired on import ({len(fixed)}{'+' if len(fixed) >= _REPAIRS_KEPT else ''}): "
            f"{fixed[0]}{'; ...' if len(fixed) > 1 else ''} (`npu-pool import` keeps them all in the trace's meta)")


def distinct_name(name: str, path: Path, seen: dict[str, Path]) -> str:
    """``name`` as a table shows the trace read from ``path``: when an earlier file gave a trace
    that name, prefixed with the fewest of the file's folders that differ from that file's
    (a/run.npt, b/run.npt: b/run; x/a/run.npt, y/a/run.npt: y/a/run), numbered when none do;
    noted in ``seen``."""
    shown = name
    if name in seen:
        mine, theirs = path.parent.parts, seen[name].parent.parts
        k = next((k for k in range(1, len(mine) + 1) if mine[-k:] != theirs[-k:]), None)
        shown = "/".join((*mine[-k:], name)).replace("//", "/") if k else name
    n = 2
    while shown in seen:
        shown, n = f"{name} ({n})", n + 1
    seen[shown] = path
    return shown


def expand(paths: list[str]) -> list[Path]:
    """Files named on a command line; a directory stands for its regular .npt and .pickle files
    (a FIFO or device there with such a name is skipped, never opened)."""
    out: list[Path] = []
    for s in paths:
        if not str(s):
            raise TraceError("an empty path was given (an unset variable?); name a trace file or a directory")
        p = Path(s)
        if p.is_dir():
            named = [q for q in p.iterdir() if q.suffix in (".npt", ".pickle")]
            found = sorted(q for q in named if q.is_file())  # is_file: a regular file (or a link to one)
            if not found:
                skipped = f" ({len(named)} with such a name are not regular files)" if named else ""
                raise TraceError(f"{p}: no .npt or .pickle traces in this directory{skipped}")
            out.extend(found)
        else:
            out.append(p)
    return out
