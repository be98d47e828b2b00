"""Open trace files of any supported kind: npu_pool traces and PyTorch snapshots."""
from __future__ import annotations

from pathlib import Path

from .format import MAGIC, PLAN_MAGIC, Trace, TraceError


def open_traces(path: str | Path) -> list[tuple[str, Trace]]:
    """(name, trace) pairs from one file: an ``.npt`` trace, or a snapshot pickle (one per device)."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            head = f.read(len(MAGIC))
    except OSError as e:
        raise TraceError(f"{p}: cannot read ({e.strerror})") from None
    if head == MAGIC or head[:7] == MAGIC[:7] or p.suffix == ".npt":
        return [(p.stem, Trace.load(p))]  # says what is wrong with a trace file
    if head[:1] != b"\x80":  # every pickle PyTorch writes starts with the protocol opcode
        what = ("an npu_pool plan (give it with --plan)" if head == PLAN_MAGIC else
                "empty" if not head else f"neither an npu_pool trace (.npt) nor a PyTorch memory snapshot (.pickle)")
        raise TraceError(f"{p}: {what}")
    from .snapshot import load_snapshot

    traces = load_snapshot(p)
    if len(traces) == 1:
        return [(p.stem, traces[0])]
    return [(f"{p.stem}.dev{t.meta.get('device', i)}", t) for i, t in enumerate(traces)]


def expand(paths: list[str]) -> list[Path]:
    """Files named on a command line; a directory stands for its .npt and .pickle files."""
    out: list[Path] = []
    for s in paths:
        p = Path(s)
        if p.is_dir():
            found = sorted(q for q in p.iterdir() if q.suffix in (".npt", ".pickle"))
            if not found:
                raise TraceError(f"{p}: no .npt or .pickle traces in this directory")
            out.extend(found)
        else:
            out.append(p)
    return out
