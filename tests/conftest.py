"""Shared fixtures: the real traces beside the repository, when present."""
from __future__ import annotations

from pathlib import Path

import pytest

SHARED_TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"


@pytest.fixture(scope="session")
def shared_traces() -> Path:
    """The folder of real PyTorch snapshots; skips the test on a fresh clone without it."""
    if not SHARED_TRACES.is_dir() or not any(SHARED_TRACES.glob("*.pickle")):
        pytest.skip("../shared/traces is absent (fresh clone)")
    return SHARED_TRACES
