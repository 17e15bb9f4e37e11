"""``scripts/demo.sh`` (the README's main command) end to end: its own ``flexspec serve``, one streamed question,
the answer text (the engine's own T=0 answer) and one summary line with the speculative acceptance from
``/metrics``; ``--speculative-config`` passed through to ``flexspec serve`` replaces the config file's drafter."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from configs import SamplingParams
from tests.cluster.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
QUESTION = "Write a Python function that returns the n-th Fibonacci number."
SUMMARY = re.compile(
    r"^(\d+) tokens in [\d.]+ s \([\d.]+ tokens/s, first token after [\d.]+ s, finish: \w+\); (.*)$"
)


def _run_demo(*serve_options: str, timeout: float = 400) -> tuple[subprocess.CompletedProcess, str]:
    """Run the demo with ``serve_options`` after the config; returns the finished process and the server's log
    (its temporary file removed)."""
    env = os.environ | {"PYTHON": sys.executable, "PORT": str(free_port())}
    proc = subprocess.run(
        ["bash", "scripts/demo.sh", "configs/serve.yaml", "--num-cpus", "2", *serve_options],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    log_path = re.search(r"\(log: (\S+)\)", proc.stdout)
    log = ""
    if log_path:
        log = Path(log_path.group(1)).read_text(errors="replace")
        Path(log_path.group(1)).unlink()
    return proc, log


def _demo(*serve_options: str) -> tuple[str, str]:
    """Run the demo, which must succeed; returns its stdout and the server's log."""
    proc, log = _run_demo(*serve_options)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + log[-3000:]
    return proc.stdout, log


def _answer_and_summary(stdout: str) -> tuple[str, re.Match]:
    assert f"Q: {QUESTION}\nA: " in stdout, stdout
    answer = stdout.split("\nA: ", 1)[1]
    lines = answer.rstrip("\n").splitlines()
    stop = lines.index("stopping the server ...")
    summary = SUMMARY.match(lines[stop - 1])
    assert summary, stdout
    assert lines[stop - 2] == "", stdout  # a blank line between the answer and the summary
    return "\n".join(lines[: stop - 2]), summary


def test_demo_prints_the_answer_and_the_acceptance_summary(engine):
    stdout, log = _demo()
    answer, summary = _answer_and_summary(stdout)
    ids = engine.apply_chat_template([{"role": "user", "content": QUESTION}])
    ref = engine.generate([ids], SamplingParams(max_tokens=96, temperature=0.0))[0]
    assert answer == ref.text  # speculation (FlexDraft, config default) is lossless at T=0
    assert int(summary.group(1)) == len(ref.token_ids)
    assert re.fullmatch(
        r"speculative decoding: mean acceptance length \d+\.\d\d \(accepted \d+ of \d+ draft tokens in \d+ verifications\); "
        r"the policy speculated in \d+ of \d+ steps \(each speculative stretch starts with a step that has no "
        r"drafts to verify; plain decoding where it expected that to be faster\)",
        summary.group(2),
    ), summary.group(2)
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]  # none of ours, also at the stop


def test_demo_passes_serve_options_through():
    """Options after CONFIG reach ``flexspec serve``: an invalid ``--speculative-config`` stops the server before
    Ray starts and the demo shows serve's one-line error (a second full demo run cost ~110 s of the suite; what
    serve does with a valid option, ``null`` included, is tested in tests/cluster/test_serve_config.py)."""
    proc, _ = _run_demo(
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}', timeout=120
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "server exited:" in proc.stdout, proc.stdout
    assert "--speculative-config.num_speculative_tokens" in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stdout, proc.stdout
