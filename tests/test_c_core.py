"""The C core built on its own as a debug build (NP_DEBUG asserts) under ASan and UBSan,
driven by the C programs in tests/c."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import unavailable

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "npu_pool" / "csrc"


@pytest.mark.parametrize("driver, expected, defines", [
    # random sequences on every policy, and with compaction on the policies that compact
    ("stress.c", ["torch:", "npu_pool:", "expandable:", "npu_pool compacting:", "planned compacting:"], []),
    ("planned.c", ["served"], []),  # the planned policy against a changing iteration
    ("tree.c", ["lowest fit: ok"], []),  # the address-ordered tree's lowest-fit search against a scan
    # the simulated device's placement (its range treap) against the linear scans it replaced
    ("simdev.c", ["simdev: ok"], []),
    # the plan's occupancy index, frozen and not, against a scan, and what a query looks at: with
    # small blocks of the frozen lists' max trees (short lists take the tree's paths) and the default
    ("occ.c", ["occ: ok", "occ cost:"], ["-DNP_ULIST_BLOCK=2"]),
    ("occ.c", ["occ: ok", "occ cost:"], []),
    ("teardown.c", ["fork before any context: ok", "closed calls: ok", "close:", "shutdown: ok", "fork: ok"], []),
    # close and fork while threads call in; every call on a closed pool
])
def test_debug_build_under_sanitizers(tmp_path, driver, expected, defines):
    cc = shutil.which("gcc") or shutil.which("cc")
    if not cc:
        unavailable("no C compiler (gcc or cc)")
    exe = tmp_path / "driver"
    sources = [str(p) for p in sorted(CSRC.glob("*.c"))] + [str(ROOT / "tests" / "c" / driver)]
    flags = ["-std=c11", "-D_GNU_SOURCE", "-DNP_DEBUG", "-g", "-O1", "-Wall", "-Wextra", "-Werror",
             "-fsanitize=address,undefined", "-fno-sanitize-recover=all", f"-I{CSRC}", *defines]
    build = subprocess.run([cc, *flags, *sources, "-o", str(exe), "-lpthread", "-lm", "-ldl"],
                           capture_output=True, text=True)
    if build.returncode and "sanitize" in build.stderr and "cannot find" in build.stderr:
        unavailable("the compiler lacks the sanitizer runtimes (libasan, libubsan)")
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300,
                         env={"ASAN_OPTIONS": "detect_leaks=1", "UBSAN_OPTIONS": "print_stacktrace=1"})
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    for word in expected:
        assert word in run.stdout
