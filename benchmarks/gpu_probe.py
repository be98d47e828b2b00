"""Probe torch's own CUDA caching allocator with a trace: does it fit at given caps, and where does
it put its segments (docs/gpu.md, "What the GPU found").

    python benchmarks/gpu_probe.py fits TRACE CAP_MIB[,CAP_MIB...]     # on a GPU
    python benchmarks/gpu_probe.py record TRACE CAP_MIB OUT.pickle      # on a GPU (CAP_MIB 0: no cap)
    python benchmarks/gpu_probe.py order SNAPSHOT.pickle...             # anywhere

``fits`` plays the trace (.npt or .pickle) as tensors once with room to spare, then once under
each cap (``torch.cuda.set_per_process_memory_fraction`` of exactly CAP_MIB MiB, as
``npu-pool replay --live`` bisects it) and prints one JSON line per cap. ``record`` plays it once
under the cap with ``torch.cuda.memory._record_memory_history`` on and dumps the snapshot.
``order`` reads snapshots and counts, for each segment allocated while others were live, whether
it landed below all of them, above all of them, or between.
"""
from __future__ import annotations

import argparse
import json
import pickle
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MiB = 1 << 20


def _player(path: str) -> tuple[Any, Any]:
    import torch

    from npu_pool.live import Player  # (the live replay's own player, as it plays)
    from npu_pool.trace.files import open_traces

    (_, trace), *_ = open_traces(Path(path))
    torch.cuda.set_device(0)
    return torch, Player(trace, torch, torch.cuda, "cuda", None)


def order(snapshots: list[str]) -> None:
    for path in snapshots:
        with open(path, "rb") as f:
            snap = pickle.load(f)  # (your own recordings: pickle runs what a file says)
        live: set[int] = set()
        below = above = between = 0
        for e in snap["device_traces"][0]:
            if e["action"] == "segment_alloc":
                if live:
                    below += e["addr"] < min(live)
                    above += e["addr"] > max(live)
                    between += min(live) < e["addr"] < max(live)
                live.add(e["addr"])
            elif e["action"] == "segment_free":
                live.discard(e["addr"])
        print(json.dumps({"snapshot": Path(path).name, "below_all": below, "above_all": above, "between": between}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    f = sub.add_parser("fits")
    f.add_argument("trace")
    f.add_argument("caps", help="MiB, comma separated")
    r = sub.add_parser("record")
    r.add_argument("trace")
    r.add_argument("cap", type=int, help="MiB (0: no cap)")
    r.add_argument("out")
    o = sub.add_parser("order")
    o.add_argument("snapshots", nargs="+")
    args = ap.parse_args(argv)
    if args.mode == "order":
        order(args.snapshots)
        return 0
    torch, player = _player(args.trace)
    if args.mode == "fits":
        player.play()
        player.reset()  # as the live replay: a room-to-spare play first
        for mib in (int(c) for c in args.caps.split(",")):
            player.cap(mib * MiB if mib else None)
            player.reset()
            failed = player.play()
            player.reset()
            print(json.dumps({"trace": args.trace, "cap_mib": mib, "ok": failed is None, "fail": failed}))
        player.cap(None)
    else:
        player.cap(args.cap * MiB if args.cap else None)
        torch.cuda.memory._record_memory_history(max_entries=10**6, context=None, stacks="python")
        failed = player.play()
        torch.cuda.memory._dump_snapshot(args.out)
        print(json.dumps({"trace": args.trace, "cap_mib": args.cap, "ok": failed is None, "fail": failed}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
