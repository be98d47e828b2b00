"""What the start-up hook (npu_pool_startup.pth) costs a Python that does not use it.

    python benchmarks/startup_hook.py [--repeats 200]

Two throwaway venvs over this Python, identical but for the .pth that setup.py installs;
``python -c pass`` is started in each, alternately (interleaved, so drift hits both alike),
``--repeats`` times with MEMORY_FRAGMENTATION unset. Prints the median start-up of each, the
difference and the ratio, and, measured in-process with timeit, the cost of the .pth's line
itself (what site.py executes); the goal is under 1 ms. Process start-up varies by about a
millisecond from run to run, so the in-process figure is the precise one and the difference
of medians bounds it from the outside.
"""
from __future__ import annotations

import argparse
import os
import site
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import npu_pool_startup  # noqa: E402


def venv(where: Path, with_pth: bool) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(where)], check=True)
    python = where / "bin" / "python"
    if with_pth:
        site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        Path(site, npu_pool_startup.PTH).write_text(npu_pool_startup.PTH_LINE)
    return python


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=200)
    a = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if k not in ("MEMORY_FRAGMENTATION", "NPU_POOL_CONFIG")}
    env["PYTHONPATH"] = str(ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        pythons = {"without": venv(Path(tmp, "without"), False), "with": venv(Path(tmp, "with"), True)}
        times: dict[str, list[float]] = {k: [] for k in pythons}
        for _ in range(a.repeats):
            for name, python in pythons.items():
                t0 = time.perf_counter()
                subprocess.run([str(python), "-c", "pass"], env=env, check=True)
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    pairs = sorted((w - wo) * 1e3 for w, wo in zip(times["with"], times["without"]))
    q1, q3 = pairs[len(pairs) // 4], pairs[3 * len(pairs) // 4]
    env_off = {k: v for k, v in os.environ.items() if k not in ("MEMORY_FRAGMENTATION", "NPU_POOL_CONFIG")}
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env_off)
    try:
        code = compile(npu_pool_startup.PTH_LINE, npu_pool_startup.PTH, "exec")
        n = 100_000
        line_us = min(timeit.repeat(lambda: exec(code, {}), number=n, repeat=5)) / n * 1e6
        with tempfile.TemporaryDirectory() as tmp:  # what site.py does with the file: open, read, run the line
            Path(tmp, npu_pool_startup.PTH).write_text(npu_pool_startup.PTH_LINE)
            m = 2_000
            file_us = min(timeit.repeat(lambda: site.addpackage(tmp, npu_pool_startup.PTH, set()), number=m,
                                        repeat=5)) / m * 1e6
    finally:
        os.environ.clear()
        os.environ.update(saved)
    print(f"python -c pass, MEMORY_FRAGMENTATION unset, {a.repeats} interleaved runs each (median):")
    print(f"  without the .pth  {med['without']:.2f} ms")
    print(f"  with the .pth     {med['with']:.2f} ms")
    print(f"  ratio of medians  {med['with'] / med['without']:.3f}")
    print(f"  difference per interleaved pair: median {statistics.median(pairs):+.2f} ms, "
          f"quartiles {q1:+.2f} .. {q3:+.2f} ms (start-up's own noise)")
    print("in-process (timeit, best of 5): the .pth's line "
          f"{line_us:.2f} us; site.addpackage on the file (open, read, run) {file_us:.1f} us; goal: under 1000 us")


if __name__ == "__main__":
    main()
