"""The HTML report: self-contained, its SVG follows the data, and it runs in headless Chromium."""
from __future__ import annotations

import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from npu_pool.analysis.breakdown import GROUP_LABELS
from npu_pool.analysis.html import downsample, render_html
from npu_pool.analysis.report import Analysis, analyze_paths, analyze_trace
from npu_pool.units import fmt_bytes
from npu_pool.cli import main
from conftest import unavailable
from test_analysis import POLICIES, toy_trace

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

@pytest.fixture
def _chromium_installed() -> None:
    if CHROMIUM is None:  # (CI installs it: .ci/run)
        unavailable("chromium is not installed (apt-get update && apt-get install -y chromium)")


needs_chromium = pytest.mark.usefixtures("_chromium_installed")


@pytest.fixture(scope="module")
def toy_analysis() -> Analysis:
    return Analysis("toy", [analyze_trace(toy_trace(layers=4, iters=3), "toy", POLICIES, curves=True)])


@pytest.fixture(scope="module")
def page(toy_analysis, tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("html") / "report.html"
    p.write_text(render_html(toy_analysis))
    return p


def _chromium(tmp_path: Path, url: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--host-resolver-rules=MAP * ~NOTFOUND",  # nothing may be fetched: the page must not need it
           f"--user-data-dir={tmp_path / 'chromium-profile'}", *args, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _points(html: str, element_id: str) -> list[tuple[float, float]]:
    pts = re.search(rf'id="{element_id}"[^>]*points="([^"]+)"', html).group(1)
    return [tuple(map(float, p.split(","))) for p in pts.split()]


def test_page_is_self_contained(page, toy_analysis):
    html = page.read_text()
    assert "http://" not in html and "https://" not in html
    assert "<link" not in html and " src=" not in html and "@import" not in html
    p = toy_analysis.traces[0].profile
    assert fmt_bytes(p.peak_live) in html and p.peak_phase.describe() in html
    for pol in POLICIES:
        assert f'id="line-{pol}"' in html
    for g, v in p.at_peak.items():
        if v:
            assert f'class="seg seg-{g}"' in html and GROUP_LABELS[g] in html
    for tid in ("breakdown", "policies", "sites", "layers"):
        assert f'<table id="{tid}" class="sortable">' in html
    assert html.count('class="stage stage-forward"') == 3  # one shaded span per iteration's forward


def test_timeline_follows_the_curves(page, toy_analysis):
    html = page.read_text()
    t = toy_analysis.traces[0]
    live = _points(html, "line-live")
    assert len(live) == t.profile.events  # small trace: every event is a point
    top = min(live, key=lambda xy: xy[1])  # SVG y grows downwards
    peak_x = float(re.search(r'<line x1="([\d.]+)"[^>]*class="peak"', html).group(1))
    assert top[0] == pytest.approx(peak_x)
    for pol in t.timelines:
        pts = _points(html, f"line-{pol}")
        assert min(y for _, y in pts) <= top[1]  # reserved is never below live
        assert len(pts) == t.profile.events


def test_downsample_keeps_every_peak():
    values = [(i * 7919) % 1000 for i in range(10_000)]
    d = downsample(values, len(values), 100)
    assert len(d) == 100 and max(v for _, v in d) == max(values) and d[0][0] == 0
    assert downsample(values, 50) == [(i, values[i]) for i in range(50)]


def test_ranks_page(tmp_path):
    d = tmp_path / "ranks"
    d.mkdir()
    for rank, act in enumerate((3 << 20, 6 << 20)):
        toy_trace(act=act).save(d / f"rank{rank}.npt")
    a = analyze_paths([str(d)], ["npu_pool"], curves=True, show_progress=False)
    html = render_html(a)
    assert "<h2>Ranks</h2>" in html and '<table id="ranks"' in html and '<table id="imbalance"' in html
    assert 'class="hot"' in html and "Details below: rank1" in html


def test_analyze_writes_html(tmp_path):
    src = tmp_path / "toy.npt"
    toy_trace().save(src)
    out = tmp_path / "toy.html"
    assert main(["analyze", str(src), "--format", "html", "--out", str(out), "--policy", "torch,npu_pool",
                 "--no-progress"]) == 0
    html = out.read_text()
    assert 'id="line-torch"' in html and 'id="line-npu_pool"' in html and 'id="line-expandable"' not in html


@needs_chromium
def test_page_runs_in_chromium(page, toy_analysis, tmp_path):
    r = _chromium(tmp_path, page.as_uri() + "#selftest", "--dump-dom")
    dom = r.stdout
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'id="report-error"' not in dom
    ready = re.search(r'<div id="report-ready"[^>]*>', dom)
    assert ready, "the page's script did not run to the end"
    assert 'data-selftest="pass"' in ready.group(0)  # sorting and filtering worked in the browser ...
    # ... as the page judges it; the self-test leaves the sites table sorted by its third column,
    # ascending: the rows, read here from the browser's DOM, must be the page's rows in that order
    def rows(html: str) -> list[tuple[str, float]]:  # (site, allocated in total) of each body row
        table = re.search(r'<table[^>]*id="sites".*?</table>', html, re.S).group(0)
        cells = [re.findall(r"<td([^>]*)>(.*?)</td>", tr) for tr in re.findall(r"<tr[^>]*>(.*?)</tr>", table, re.S)]
        return [(c[0][1], float(re.search(r'data-v="([^"]*)"', c[2][0]).group(1))) for c in cells if c]
    before, after = rows(page.read_text()), rows(dom)
    assert [v for _, v in before] != sorted(v for _, v in before)  # (so that a sort that does nothing shows)
    assert [v for _, v in after] == sorted(v for _, v in before) and sorted(after) == sorted(before), after
    assert f'data-tables="{page.read_text().count("<table ")}"' in ready.group(0)
    assert fmt_bytes(toy_analysis.traces[0].profile.peak_live) in dom
    for pol in POLICIES:
        assert f"peak reserved: {pol}" in dom


@needs_chromium
def test_chromium_reports_script_errors(page, tmp_path):
    broken = tmp_path / "broken.html"
    broken.write_text(page.read_text().replace("</body>", "<script>no_such_function();</script></body>"))
    dom = _chromium(tmp_path, broken.as_uri(), "--dump-dom").stdout
    assert 'id="report-error"' in dom and "no_such_function" in dom


@needs_chromium
def test_screenshot(page, tmp_path):
    png = tmp_path / "shot.png"
    r = _chromium(tmp_path, page.as_uri(), f"--screenshot={png}", "--window-size=1100,1600", "--hide-scrollbars")
    assert r.returncode == 0 and png.exists(), r.stderr[-2000:]
    head = png.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", head[16:24]) == (1100, 1600)


_RETAINED = """
import gc, os
from npu_pool.analysis.report import analyze_trace
from npu_pool.trace.format import OP_ALLOC, OP_FREE, Trace
MiB, N = 1 << 20, 200000
t = Trace(meta={"origin": "synthetic", "n_ids": N})
for i in range(N):
    t.append(OP_ALLOC, id=i, size=(i % 7 + 1) * MiB)
    if i >= 3:
        t.append(OP_FREE, id=i - 3, size=((i - 3) % 7 + 1) * MiB)
def rss():
    gc.collect()
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = rss()
a = analyze_trace(t, "t", ["torch", "npu_pool"], curves=True)
print((rss() - before) / len(t) / 2)
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the resident size from /proc (Linux)")
def test_an_analysis_for_the_page_keeps_its_curves_not_the_replays_histories() -> None:
    """The HTML report draws reserved bytes per event: an analysis made for it keeps that curve, not
    each replay's whole event history (56 bytes a record, about two a trace event), which it held
    for every policy and trace until the page was rendered (analyze --format html of four ranks of
    a 1M-event trace: 1.33 GB where md took 183 MB; a review of the commands at scale, a helper).
    Here about 44 bytes a trace event and policy stay; before, about 100."""
    import sys

    r = subprocess.run([sys.executable, "-c", _RETAINED], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert float(r.stdout.strip()) < 72

