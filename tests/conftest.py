"""Shared fixtures: the real traces beside the repository, and the real torch_npu over a fake
CANN runtime (each when present)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
SHARED_TRACES = SHARED / "traces"
TORCH_NPU_VERSION = "2.13.0"
sys.path.insert(0, str(Path(__file__).parent / "fake_vendor"))
try:
    import cann  # the fake CANN runtime: its build and the environment of a process over it
finally:
    sys.path.pop(0)


@pytest.fixture(scope="session", autouse=True)
def _hooks_cache(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The C++ hooks the tests build go to a folder of the session, never the user's ~/.cache."""
    before = os.environ.get("NPU_POOL_CACHE")
    os.environ["NPU_POOL_CACHE"] = str(tmp_path_factory.mktemp("hooks_cache"))
    yield
    if before is None:
        os.environ.pop("NPU_POOL_CACHE", None)
    else:
        os.environ["NPU_POOL_CACHE"] = before


@pytest.fixture(scope="session")
def shared_traces() -> Path:
    """The folder of real PyTorch snapshots; skips the test on a fresh clone without it."""
    if not SHARED_TRACES.is_dir() or not any(SHARED_TRACES.glob("*.pickle")):
        unavailable("../shared/traces is absent (fresh clone)")
    return SHARED_TRACES


def in_ci() -> bool:
    """Whether this is CI (``CI`` set), where every test must run."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false")


def unavailable(why: str) -> None:
    """Skip with a reason; in CI (``CI`` set), where everything must run, fail instead."""
    if in_ci():
        pytest.fail(f"{why} (CI must run these tests: `./run test` installs what they need)")
    pytest.skip(why)


def mcore_missing() -> str:
    """Why megatron-core cannot be used here ('' when it can): not installed, or broken (said,
    not taken for absent)."""
    try:
        import megatron.core  # noqa: F401
    except Exception as e:
        return f"megatron-core is not importable ({type(e).__name__}: {e})"[:300]
    return ""


@pytest.fixture
def megatron_core() -> None:
    """For tests that train megatron-core's GPTModel on CPU (`pytest.mark.usefixtures`)."""
    why = mcore_missing()
    if why:  # (./run test installs it: CI runs these)
        unavailable(why)


@dataclass
class TorchNpu:
    """A Python with the real torch_npu, and a fake CANN runtime for it to start on."""

    python: str
    cann: Path    # fake libascendcl.so and companions (LD_LIBRARY_PATH)
    cache: Path   # where npu_pool builds its torch_npu hooks (once per test session)

    def env(self, **extra: str) -> dict[str, str]:
        return cann.env(self.cann, ROOT, self.cache, **extra)

    def run(self, code: str, timeout: int = 300, **env: str) -> subprocess.CompletedProcess:
        """Run ``code`` under torch_npu; the test asserts on its output."""
        return subprocess.run([self.python, "-c", code], env=self.env(**env), capture_output=True, text=True,
                              timeout=timeout, cwd=str(ROOT))

    def results(self, code: str, **env: str) -> tuple[dict[str, Any], str]:
        """Run ``code``, which prints one JSON object as its last stdout line; (that object, stderr)."""
        r = self.run(code, **env)
        lines = r.stdout.strip().splitlines()
        assert r.returncode == 0 and lines, f"exit {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-5000:]}"
        return json.loads(lines[-1]), r.stderr


@pytest.fixture(scope="session")
def torch_npu(tmp_path_factory: pytest.TempPathFactory) -> TorchNpu:
    """The venv `./run test` makes with torch-npu, started over the fake CANN runtime."""
    python = os.environ.get("NPU_POOL_TORCH_NPU_PYTHON") or str(ROOT / ".venv-torch-npu" / "bin" / "python")
    if not Path(python).exists():
        unavailable(f"no Python with torch_npu at {python} (`./run test` makes .venv-torch-npu)")
    probe = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('torch-npu'))"],
                           capture_output=True, text=True, timeout=60)
    version = probe.stdout.strip()
    if probe.returncode or version != TORCH_NPU_VERSION:
        unavailable(f"{python} has no torch-npu {TORCH_NPU_VERSION} ({version or probe.stderr.strip()[-200:]})")
    try:
        lib_dir = cann.build(tmp_path_factory.mktemp("fake_cann"))
    except cann.BuildError as e:
        unavailable(f"the fake CANN runtime could not be built: {e}")
    return TorchNpu(python, lib_dir, tmp_path_factory.mktemp("npu_pool_cache"))
