"""Write the README's demo transcript and screenshot: ``python benchmarks/demo_screenshot.py``.

Runs ``npu-pool demo`` (what ``./run demo`` runs once set up), writes its whole output, stderr's
progress lines in place, to docs/img/demo_terminal.txt, and renders its first screen (up to the
paragraph after the 7B table) as docs/img/demo_terminal.png in headless Chromium (``chromium``
or ``chromium-browser`` on the PATH; its profile in a temporary folder). Only the capture timings
differ from run to run, given the same ../shared/traces (without them, their rows and the sums
over all traces differ: the committed transcript was made with them).
"""
from __future__ import annotations

import html
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TXT = ROOT / "docs" / "img" / "demo_terminal.txt"
PNG = ROOT / "docs" / "img" / "demo_terminal.png"
SIZE = "860,560"  # pixels: the first screen


def transcript() -> str:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # stderr's lines where they come
    r = subprocess.run([sys.executable, "-m", "npu_pool.cli", "demo"], cwd=ROOT, env=env, text=True,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=True)
    return r.stdout


def first_screen(text: str) -> list[str]:
    lines = text.splitlines()
    end = next(i for i, line in enumerate(lines) if line.startswith("made offline"))  # the 7B paragraph's end
    return ["$ ./run demo", *lines[:end + 1]]


def render(lines: list[str], out: Path) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if not browser:
        raise SystemExit("demo_screenshot: no chromium on the PATH (Debian, Ubuntu: apt-get install chromium)")
    page = ("<html><body style='margin:0;background:#1e1e1e'><pre style='margin:0;padding:12px 14px;color:#d4d4d4;"
            "font:14px/19px DejaVu Sans Mono,monospace'>" + html.escape("\n".join(lines)) + "</pre></body></html>")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "demo.html"
        src.write_text(page)
        profile = f"--user-data-dir={Path(tmp) / 'profile'}"  # (its state, and dconf's below, stay in tmp)
        env = {**os.environ, "XDG_CONFIG_HOME": tmp, "XDG_CACHE_HOME": tmp}
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", profile,
                        f"--window-size={SIZE}", f"--screenshot={out}", src.as_uri()],
                       check=True, capture_output=True, timeout=120, env=env)


def main() -> int:
    text = transcript()
    TXT.write_text(text)
    render(first_screen(text), PNG)
    print(f"wrote {TXT.relative_to(ROOT)} and {PNG.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
