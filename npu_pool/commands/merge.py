"""``npu-pool merge DIR``: every rank's memory report of a run in one table.

Ranks write ``npu_pool_rank<N>.json`` at exit when ``NPU_POOL_REPORT_DIR`` is set (see
``mindspeed_patch.megatron``); this puts them side by side and states the imbalance
across ranks (which rank peaks highest, by how much).
"""
from __future__ import annotations

import argparse
import json
import sys

from ..recorder import report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", metavar="DIR", help="the run's NPU_POOL_REPORT_DIR (holds npu_pool_rank*.json)")
    p.add_argument("--json", metavar="OUT", help="also write the merged reports and the imbalance as JSON")


def run(args: argparse.Namespace) -> int:
    reports = report.load(args.directory)
    print(report.merge_table(reports))
    if args.json:
        from ..outputs import output

        with output(args.json, "w") as f:  # whole or absent
            json.dump({"ranks": reports, "imbalance": report.imbalance(reports)}, f, indent=1)
        print(f"wrote {len(reports)} rank reports to {args.json}", file=sys.stderr)
    return 0
