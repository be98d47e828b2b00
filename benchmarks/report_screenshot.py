"""Write docs/analysis.md's two screenshots of the HTML report: ``python benchmarks/report_screenshot.py``.

docs/img/report.png: a Llama-style model trained 3 steps with activation recompute (``npu-pool
capture --model llama --steps 3 --recompute``), analysed with ``--format html --estimate
--min-capacity``; docs/img/report_imported.png: the shared snapshot
cs336-medium-ctx128-train.pickle (``../shared/traces``; skipped without it), analysed with
``--format html``. Each page is rendered in headless Chromium (``chromium`` or
``chromium-browser`` on the PATH). Prints the figures docs/analysis.md's caption quotes.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMG = ROOT / "docs" / "img"
SHARED = ROOT.parent / "shared" / "traces" / "cs336-medium-ctx128-train.pickle"
MiB = 1 << 20


def cli(cwd: Path, *args: str) -> None:
    """An npu-pool command of this checkout, run in ``cwd`` (the page's title is the name as given)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-m", "npu_pool.cli", *args], cwd=cwd, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def render(page: Path, out: Path, size: str) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if not browser:
        raise SystemExit("report_screenshot: no chromium on the PATH (Debian, Ubuntu: apt-get install chromium)")
    with tempfile.TemporaryDirectory() as tmp:  # chromium's profile and dconf's cache stay in tmp
        profile = f"--user-data-dir={Path(tmp) / 'profile'}"
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", profile,
                        "--virtual-time-budget=5000", f"--window-size={size}", f"--screenshot={out}", page.as_uri()],
                       check=True, capture_output=True, timeout=180,
                       env={**os.environ, "XDG_CONFIG_HOME": tmp, "XDG_CACHE_HOME": tmp})


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        cli(t, "capture", "--model", "llama", "--steps", "3", "--recompute", "-o", "llama-recompute.npt",
            "--no-progress")
        cli(t, "analyze", "llama-recompute.npt", "--format", "html", "--estimate", "--min-capacity",
            "--no-progress", "-o", "report.html")
        cli(t, "analyze", "llama-recompute.npt", "--format", "json", "--min-capacity", "--no-progress",
            "-o", "report.json")
        render(t / "report.html", IMG / "report.png", "1100,1500")
        a = json.loads((t / "report.json").read_text())["traces"][0]
        print(f"llama-recompute: peak live {a['peak_live_bytes'] / MiB:.1f} MiB")
        for p in a["policies"]:
            print(f"  {p['policy']}: peak reserved {p['peak_reserved_bytes'] / MiB:.0f} MiB, "
                  f"minimum capacity {p['min_capacity_bytes'] / MiB:.0f} MiB")
        if SHARED.exists():
            shutil.copy(SHARED, t / SHARED.name)
            cli(t, "analyze", SHARED.name, "--format", "html", "--no-progress", "-o", "imported.html")
            render(t / "imported.html", IMG / "report_imported.png", "1100,1300")
        else:
            print(f"report_screenshot: no {SHARED}: report_imported.png left as it is", file=sys.stderr)
    print("wrote docs/img/report.png" + (" and report_imported.png" if SHARED.exists() else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
