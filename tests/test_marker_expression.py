"""README's test command selects tests by marker (``-m "not serial"``, ``-m serial``): a misspelt marker is a usage
error naming it (tests/conftest.py ``pytest_configure``), not a run that deselects everything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _collect(expr: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", "-m", expr,
           "tests/engine/test_thread_count.py"]  # fmt: skip
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)


def test_a_misspelt_marker_is_a_usage_error():
    r = _collect("not serail")
    assert r.returncode == pytest.ExitCode.USAGE_ERROR, r.stdout + r.stderr
    assert "unknown marker(s) serail" in r.stderr + r.stdout


@pytest.mark.parametrize("expr", ["not serial", "serial or (slow and not gpu)"])
def test_registered_markers_pass(expr):
    r = _collect(expr)
    assert r.returncode in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED), r.stdout + r.stderr
