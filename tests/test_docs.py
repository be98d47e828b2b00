"""The docs run: every shell and Python example of README.md and docs/*.md is executed, and
the output it shows is compared with what it prints.

The convention (the first word of a fence's info string is its language, as GitHub reads it):

- ```` ```console doc-run ````: a shell session, run by bash in a fresh temporary folder
  (``npu-pool`` is ``python -m npu_pool.cli`` of this tree). A line ``$ COMMAND`` is run (a
  line ending in ``\\`` continues it); the lines up to the next ``$`` are what it prints
  (stdout and stderr together), all of them.
- ```` ```python doc-run ````: Python, run in a fresh temporary folder. A ```` ```text doc-output ````
  block right after it is what it prints.
- ```` ```LANG doc-skip: REASON ````: not run (a device, a synopsis with placeholders, an excerpt
  of the code); the reason is the test's skip reason.
- Shown output is compared line by line (trailing spaces ignored): a line ``...`` stands for
  any number of lines, and ``...`` inside a line for any text (timings, paths).
- A ``sh``/``bash``/``shell``/``console``/``python`` block, or a block with no language, must
  carry ``doc-run`` or ``doc-skip: REASON``: an unmarked one fails, naming its file and line.
  Other languages (``yaml``, ``text``, ``json``, ``c``) are data and are not run.

Each block is one test, named ``FILE:LINE``; a failure shows the command, what was expected
and what came, so the block to fix is plain. Examples must stay small (seconds each).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = {"", "sh", "bash", "shell", "console", "python", "py", "pycon"}
TIMEOUT = 180
# Sections another change is rewriting: (file, heading) -> why; their unmarked blocks xfail until marked.
PENDING: dict[tuple[str, str], str] = {}


@dataclass
class Block:
    path: Path
    line: int          # of the opening fence
    lang: str
    marker: str        # "doc-run", "doc-skip: ...", "doc-output" or ""
    text: str
    section: str       # the heading above it
    output: str | None = None  # a python block's doc-output

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown file, python blocks joined with their doc-output."""
    out: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i, section = 0, ""
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            if lines[i].startswith("#"):
                section = lines[i].strip()
            i += 1
            continue
        indent, fence, info = m.group(1), m.group(2), m.group(3).strip()
        body, j = [], i + 1
        while j < len(lines) and not (lines[j].strip().startswith(fence) and lines[j].strip().strip(fence[0]) == ""):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        lang, _, marker = info.partition(" ")
        b = Block(path, i + 1, lang.lower(), marker.strip(), "\n".join(body) + "\n", section)
        if b.marker == "doc-output" and out and out[-1].lang in ("python", "py") and out[-1].output is None:
            out[-1].output = b.text
        else:
            out.append(b)
        i = j + 1
    return out


ALL = [b for p in DOCS for b in blocks(p)]
CHECKED = [b for b in ALL if b.lang in RUNNABLE or b.marker.startswith(("doc-run", "doc-skip"))]


def _matches(expected: str, got: str) -> bool:
    """``expected`` with ``...`` lines (any lines) and ``...`` in lines (any text) against ``got``."""
    pattern = []
    for line in expected.rstrip("\n").splitlines():
        line = line.rstrip()
        if line.strip() == "...":
            pattern.append(r"(?:[^\n]*\n)*?")
        else:
            pattern.append(".*?".join(re.escape(part) for part in line.split("...")) + r"[ \t]*\n")
    got = "\n".join(ln.rstrip() for ln in got.splitlines()) + "\n" if got.strip() else ""
    return re.fullmatch("".join(pattern), got) is not None if pattern else got == ""  # ('...' in a line: that line)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMORY_FRAGMENTATION", "NPU_POOL_",
                                                                        "PYTORCH_", "OOM_SNAPSHOT"))}
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", COLUMNS="100", OMP_NUM_THREADS="1")
    return env


def _commands(text: str) -> list[tuple[str, str]]:
    """A console block as (command, expected output) pairs."""
    pairs: list[tuple[str, list[str]]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("$ "):
            cmd = [line[2:]]
            while cmd[-1].rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd.append(lines[i])
            pairs.append(("\n".join(cmd), []))
        elif pairs:
            pairs[-1][1].append(line)
        elif line.strip():
            raise AssertionError(f"a console block starts with output, not a `$ ` command: {line!r}")
        i += 1
    return [(c, "\n".join(o) + "\n" if o else "") for c, o in pairs]


PRELUDE = f'npu-pool() {{ "{sys.executable}" -m npu_pool.cli "$@"; }}\nexport -f npu-pool\n'


def _run_console(block: Block, cwd: Path) -> None:
    for cmd, expected in _commands(block.text):
        r = subprocess.run(["bash", "-c", PRELUDE + cmd], cwd=cwd, env=_env(), capture_output=True, text=True,
                           timeout=TIMEOUT)
        got = r.stdout + r.stderr
        assert _matches(expected, got), (f"{block.name}: `{cmd}` (exit {r.returncode}) printed what the doc does "
                                         f"not show\n--- the doc shows:\n{expected}--- it printed:\n{got}")
        assert r.returncode == 0, f"{block.name}: `{cmd}` failed (exit {r.returncode}):\n{got}"


def _run_python(block: Block, cwd: Path) -> None:
    r = subprocess.run([sys.executable, "-c", block.text], cwd=cwd, env=_env(), capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.returncode == 0, f"{block.name}: the example failed (exit {r.returncode}):\n{r.stdout}{r.stderr}"
    expected = block.output if block.output is not None else ""
    assert _matches(expected, r.stdout), (f"{block.name}: the example printed what the doc does not show\n"
                                          f"--- the doc shows:\n{expected}--- it printed:\n{r.stdout}")


@pytest.mark.parametrize("block", CHECKED, ids=[b.name for b in CHECKED])
def test_doc_example(block: Block, tmp_path: Path) -> None:
    first = next((ln.strip() for ln in block.text.splitlines() if ln.strip()), "")
    pending = PENDING.get((str(block.path.relative_to(ROOT)), block.section))
    if block.marker.startswith("doc-skip"):
        reason = block.marker.partition(":")[2].strip()
        assert reason, f"{block.name}: doc-skip needs a reason (`doc-skip: needs an NPU`)"
        pytest.skip(f"{block.name}: {reason}")
    if block.marker != "doc-run":
        if pending:
            pytest.xfail(f"{block.name}: not marked yet ({pending})")
        pytest.fail(f"{block.name}: a {block.lang or 'plain'} block without `doc-run` or `doc-skip: REASON` after "
                    f"its language (first line: {first!r}); see tests/test_docs.py for the convention")
    if block.lang in ("python", "py"):
        _run_python(block, tmp_path)
    elif block.lang == "console":
        _run_console(block, tmp_path)
    else:
        pytest.fail(f"{block.name}: doc-run works on `console` (a $ session) and `python` blocks, not {block.lang!r}")


def test_the_convention_is_checked() -> None:
    """The matcher and the block reader themselves (so that a pass above means something)."""
    assert _matches("a\n...\nz\n", "a\nb\nc\nz\n") and _matches("t ... s\n", "t 0.41 s\n")
    assert not _matches("a\nz\n", "a\nb\nz\n") and not _matches("x 1\n", "x 2\n") and not _matches("", "out\n")
    assert not _matches("t ... s\n", "t 0.41\nTraceback (most recent call last):\nboom s\n")  # within one line
    assert _commands("$ a \\\n  b\nout\n$ c\n") == [("a \\\n  b", "out\n"), ("c", "")]
    assert len(CHECKED) >= 10 and any(b.marker == "doc-run" for b in CHECKED)


def test_the_per_iteration_line_is_what_docs_recorder_shows() -> None:
    """docs/recorder.md's per-iteration line, under npu_pool (one shared arena) and the torch
    policy (pools with memory of their own), comes from recorder.report.format_line."""
    from npu_pool import Pool
    from npu_pool.recorder import report

    doc = (ROOT / "docs" / "recorder.md").read_text()
    for policy, shape in (("npu_pool", r"long [\d.]+ short [\d.]+ GiB allocated \(one shared arena\)"),
                          ("torch", r"small [\d.]+/[\d.]+ large [\d.]+/[\d.]+ GiB \(allocated/reserved\)")):
        with Pool(policy, capacity=1 << 34) as p:
            held = [p.malloc(30 << 20, lifetime="long"), p.malloc(11 << 20, lifetime="short"), p.malloc(4096)]
            line = report.format_line({"rank": 3, "step_seconds": {"last": 0.912},
                                       "memory": report.memory_of(p.stats())}, 120)
            for ptr in held:
                p.free(ptr)
        assert re.search(shape, line), line
        assert re.search(shape, doc), f"docs/recorder.md does not show the {policy} policy's form: {shape}"
    assert "| device mallocs " in line and line.startswith("[npu_pool rank 3] iter 120 | step 0.912 s | allocated ")
