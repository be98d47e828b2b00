"""``npu-pool import SNAPSHOT... --out DIR``: PyTorch memory snapshots to npu_pool traces.

Writes ``<stem>.dev<N>.npt`` for each device with recorded events and prints one line
per trace. Bad input raises TraceError, which the CLI reports as a one-line error.
"""
from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

from npu_pool.outputs import check
from npu_pool.trace import Trace, TraceError
from npu_pool.trace.snapshot import load_snapshot
from npu_pool.trace.stats import initial_live_bytes, live_profile, op_counts

_GIB = float(1 << 30)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the command's arguments."""
    parser.add_argument("snapshots", nargs="+", metavar="SNAPSHOT", type=Path,
                        help="pickle written by torch.cuda.memory._dump_snapshot()")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR",
                        help="folder for the .npt traces (created if missing)")


def _summary(path: Path, t: Trace) -> str:
    counts = op_counts(t)
    prof = live_profile(t)
    n_init = counts.get("init_alloc", 0)
    line = (f"{path.name}: {len(t)} events, {counts.get('alloc', 0) + n_init} allocations "
            f"({n_init} of them live when the recording began), "
            f"initial live {initial_live_bytes(t) / _GIB:.2f} GiB, peak live {prof.peak_bytes / _GIB:.2f} GiB, "
            f"recorded reserved {t.meta['recorded']['peak_reserved_bytes'] / _GIB:.2f} GiB")
    n_warn = len(t.meta.get("warnings", []))
    return line + (f" ({n_warn} warnings in meta)" if n_warn else "")


def run(args: argparse.Namespace) -> int:
    """Import every snapshot; stop at the first one that cannot be read. Each trace file is
    whole or absent; an output folder made for nothing is removed."""
    out: Path = args.out
    if out.exists() and not out.is_dir():
        raise TraceError(f"{out}: exists and is not a folder; --out names the folder for the traces")
    stems: dict[str, Path] = {}
    for snap in args.snapshots:  # <stem>.dev<N>.npt: two snapshots of one name would overwrite each other
        first = stems.setdefault(snap.stem, snap)
        if first != snap:
            raise TraceError(f"{first} and {snap} would both be written as {snap.stem}.dev<N>.npt in {out}; "
                             "import them into different folders (or rename one)")
    made, written = False, 0
    try:
        # the folder made and a file claimed in it now, not after reading a large snapshot (removed below
        # when nothing was written, by the run that made it)
        try:
            out.mkdir(parents=True)
            made = True
        except FileExistsError:
            pass  # (another run's, maybe a moment ago: it is not this run's to remove)
        except OSError as e:
            raise TraceError(f"{out}: cannot create output folder ({e.strerror or e})") from None
        if args.snapshots:
            check(out / f"{args.snapshots[0].stem}.dev0.npt")
        for snap in args.snapshots:
            traces = load_snapshot(snap)  # checks the file's first bytes before reading the rest
            while traces:
                t = traces.pop(0)  # each trace freed once written
                t.validate(f"{snap} (device {t.meta.get('device', 0)})")
                dest = out / f"{snap.stem}.dev{t.meta['device']}.npt"
                # again: an import into the same folder that made it and failed removes it, maybe while
                # this one read its snapshot (two at once: the second's file then could not be written)
                with contextlib.suppress(OSError):  # (what is wrong then, the save says)
                    out.mkdir(parents=True, exist_ok=True)
                t.save(dest)
                written += 1
                print(_summary(dest, t))
    finally:
        if made and not written:
            try:
                out.rmdir()  # a folder made for nothing: leave no trace of the failed run
            except OSError:
                pass
    return 0
