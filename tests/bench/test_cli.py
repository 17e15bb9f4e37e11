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


# Errors the user can fix, raised past argparse: a FlexspecError, a pydantic error of the engine's config, JSON.
USER_ERRORS = [
    ("spec", ["--model", "nope"], "error: unknown model 'nope'"),
    (
        "synthetic",
        ["--profile", "abc"],
        "error: an option that takes JSON is not valid JSON: Expecting value",
    ),
    (
        "engine",
        ["--gpu-memory-utilization", "5", "--systems", "flexspec", "--batch-sizes", "1", "--device", "cpu"],
        "error: gpu_memory_utilization: Input should be less than or equal to 1",
    ),
]


@pytest.mark.parametrize(("suite", "args", "expected"), USER_ERRORS, ids=[c[0] for c in USER_ERRORS])
def test_user_errors_are_one_line_under_both_entry_points(suite, args, expected):
    proc = _python_m(SUITES[suite], *args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(expected) and proc.stderr.count("\n") == 1, proc.stderr
    result = CliRunner().invoke(app, ["bench", suite, *args])
    assert result.exit_code == 2, result.output
    assert result.output == proc.stderr


def test_python_m_keeps_the_traceback_of_other_errors(tmp_path):
    """Only user errors become one line: anything else (here a results file of no known schema) is a bug."""
    path = tmp_path / "results.json"
    path.write_text('{"schema": "flexspec.bench.unknown/1"}')
    proc = _python_m("bench.table", str(path))
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "KeyError" in proc.stderr


def test_output_path_checks_the_file_can_be_written(tmp_path):
    import argparse

    from bench.common import output_dir, output_path

    assert output_path(str(tmp_path / "new" / "r.json")) == tmp_path / "new" / "r.json"
    assert (tmp_path / "new").is_dir() and not list((tmp_path / "new").iterdir())  # the probe file is gone
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    for bad, why in [
        ("", "expected a file path"),
        ("-", "expected a file path"),
        (str(tmp_path), "is a folder"),
        (str(blocker / "r.json"), "is a file, not a folder"),
        (str(blocker / "sub" / "r.json"), "is a file, not a folder"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            output_path(bad)
    assert output_dir(str(tmp_path / "plots" / "x")).is_dir()
    with pytest.raises(argparse.ArgumentTypeError, match="is a file, not a folder"):
        output_dir(str(blocker))


def test_spec_bench_checks_the_plots_folder_before_measuring(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    proc = _python_m("bench.spec_bench", "--plots", str(blocker))
    assert proc.returncode == 2 and "argument --plots: cannot write" in proc.stderr, proc.stderr


# Every benchmark that writes a results file checks --output before it measures anything (root ignores file modes,
# so "unwritable" here is a path under a regular file).
OUTPUT_MODULES = [
    "bench.acceptance_trace",
    "bench.engine_bench",
    "bench.host_staging",
    "bench.load_test",
    "bench.plain_overhead",
    "bench.policy_replay",
    "bench.skinny_bench",
    "bench.spec_bench",
    "bench.step_log_report",
    "bench.synthetic",
]


@pytest.mark.parametrize("module", OUTPUT_MODULES)
def test_unwritable_output_is_a_usage_error(module, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    proc = _python_m(module, "--output", str(blocker / "r.json"))
    assert proc.returncode == 2, proc.stderr
    assert "argument --output: cannot write" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
