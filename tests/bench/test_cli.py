"""The benchmark entry points: ``flexspec bench [SUITE]`` (bench/cli.py) and ``python -m bench.SUITE``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bench.cli import SUITES
from flexspec.cli import app

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("args", "usage"),
    [
        (["bench", "--help"], "usage: flexspec bench [-h]"),
        *((["bench", suite, "--help"], f"usage: flexspec bench {suite} [-h]") for suite in SUITES),
    ],
)
def test_flexspec_bench_usage_names_the_command(args, usage):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.output.startswith(usage), result.output


def test_flexspec_bench_argument_errors_name_the_command():
    result = CliRunner().invoke(app, ["bench", "engine", "--batch-sizes", "x"])
    assert result.exit_code == 2
    assert "flexspec bench engine: error: argument --batch-sizes" in result.output


def _python_m(module: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", module, *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False, timeout=300)


def test_python_m_keeps_its_own_usage():
    proc = _python_m("bench.spec_bench", "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: python -m bench.spec_bench [-h]")
