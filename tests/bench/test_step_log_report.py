"""bench.step_log_report: spec_bench step logs summarized by mode and switch class."""

from __future__ import annotations

import json
import tarfile

import pytest

from bench.step_log_report import main as report_main
from bench.step_log_report import step_class


def _step(mode, wall, exe, decode=True, ahead=False, rnd=0, reason="best"):
    return {"round": rnd, "num_seqs": 4, "num_tokens": 4, "decode": decode, "mode": mode, "launched": True,
            "ahead": ahead, "wall_ms": wall, "exec_ms": exe, "draft_ms": 0.0, "reason": reason}  # fmt: skip


def _write(folder, name, steps):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("".join(json.dumps(s) + "\n" for s in steps))


def test_classes():
    assert step_class(None, "plain", True) == "start"
    assert step_class("plain", "plain", True) == "steady"
    assert step_class("plain", "decoupled", True) == "enter"
    assert step_class("decoupled", "plain", True) == "exit"
    assert step_class("decoupled", "parallel", True) == "switch"
    assert step_class("plain", "decoupled", False) == "prefill"


def test_steps_are_classed_per_round_and_summarized(tmp_path):
    steps = [
        _step("plain", 1.0, 0.5),  # start
        _step("plain", 1.0, 0.4, ahead=True),
        _step("plain", 3.0, 0.4, ahead=True),
        _step("decoupled", 5.0, 4.0, reason="probe"),  # enter
        _step("decoupled", 2.0, 1.5, reason="probe"),
        _step("plain", 4.0, 3.0),  # exit
        _step("plain", 9.0, 8.0, decode=False),  # prefill
        _step("decoupled", 2.0, 1.0, rnd=1),  # a new round starts afresh: not an entry
        {k: v for k, v in _step("decoupled", 2.0, 1.0, rnd=1).items() if k != "reason"},  # older logs: none
    ]
    _write(tmp_path / "steps", "auto_gsm8k_b4.jsonl", steps)
    doc = report_main([str(tmp_path / "steps"), "--output", str(tmp_path / "r.json")])
    (f,) = doc["files"]
    assert {r["bucket"] for r in f["rows"]} == {4}  # 4 sequences in every step
    rows = {(r["mode"], r["class"]): r for r in f["rows"]}
    assert f["steps"] == 9 and f["wall_ms_total"] == 29.0
    assert {k: r["steps"] for k, r in rows.items()} == {
        ("plain", "start"): 1,
        ("plain", "steady"): 2,
        ("decoupled", "enter"): 1,
        ("decoupled", "steady"): 2,  # one in each round
        ("plain", "exit"): 1,
        ("plain", "prefill"): 1,
        ("decoupled", "start"): 1,
    }
    steady = rows[("plain", "steady")]
    assert steady["wall_ms_mean"] == 2.0 and steady["wall_ms_p50"] == 2.0 and steady["host_ms_mean"] == 1.6
    assert steady["ahead_share"] == 1.0 and steady["time_share"] == pytest.approx(4.0 / 29.0, abs=1e-4)
    assert (
        rows[("decoupled", "enter")]["exec_ms_mean"] == 4.0 and rows[("plain", "exit")]["wall_ms_p50"] == 4.0
    )
    assert rows[("decoupled", "steady")]["reasons"] == {"probe": 1}  # the other one's log has no reason
    assert rows[("plain", "steady")]["reasons"] == {"best": 2}
    assert json.loads((tmp_path / "r.json").read_text())["files"] == doc["files"]
    # the same logs as stored under bench/results (a .tgz or .tar.xz of the folder) give the same summary
    for name, mode in (("steps.tgz", "w:gz"), ("steps.tar.xz", "w:xz")):
        with tarfile.open(tmp_path / name, mode) as tar:
            tar.add(tmp_path / "steps", arcname="steps")
        assert report_main([str(tmp_path / name)])["files"] == doc["files"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file or folder"),
        ("", "no .jsonl step logs"),
        ('{"mode": "plain"}\n', "line 1: not a spec_bench step record"),
        ("not json\n", "line 1: not a spec_bench step record"),
        (json.dumps({**_step("plain", 1, 1), "mode": None}) + "\n", "line 1: not a spec_bench step record"),
        (json.dumps({**_step("plain", 1, 1), "mode": ["x"]}) + "\n", "line 1: not a spec_bench step record"),
        (
            json.dumps({**_step("plain", 1, 1), "decode": "false"}) + "\n",
            "line 1: not a spec_bench step record",
        ),
        (json.dumps(_step("plain", float("nan"), 1)) + "\n", "line 1: not a spec_bench step record"),
        (b"\xff\xfe\n", "x_gsm8k_b1.jsonl: not UTF-8 text"),
        (
            json.dumps(_step("plain", 1, 1))[:-1] + ', "num_seqs": Infinity}\n',
            "line 1: not a spec_bench step record",
        ),
    ],
)
def test_bad_input_is_one_usage_error(tmp_path, capsys, content, message):
    folder = tmp_path / "steps"
    if content is not None:
        folder.mkdir()
        if content:
            path = folder / "x_gsm8k_b1.jsonl"
            path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    with pytest.raises(SystemExit) as exc:
        report_main([str(folder)])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["truncated", "early", "not_tar"])
def test_a_damaged_archive_is_one_usage_error(tmp_path, capsys, damage):
    _write(tmp_path / "steps", "a_gsm8k_b1.jsonl", [_step("plain", 1.0, 0.5)] * 2000)
    with tarfile.open(tmp_path / "steps.tgz", "w:gz") as tar:
        tar.add(tmp_path / "steps", arcname="steps")
    data = (tmp_path / "steps.tgz").read_bytes()
    bad = tmp_path / "bad.tgz"
    cut = {"truncated": data[: len(data) // 2], "early": data[:100]}
    bad.write_bytes(cut.get(damage, b"plain text, not an archive\n"))
    with pytest.raises(SystemExit) as exc:
        report_main([str(bad)])
    err = capsys.readouterr().err
    want = "nor a tar archive" if damage == "not_tar" else "damaged archive"
    assert exc.value.code == 2 and want in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 2  # usage line + one error line


def test_folders_named_like_logs_are_skipped(tmp_path):
    _write(tmp_path / "steps", "a_gsm8k_b1.jsonl", [_step("plain", 1.0, 0.5)])
    (tmp_path / "steps" / "odd.jsonl").mkdir()
    doc = report_main([str(tmp_path / "steps")])
    assert [f["file"] for f in doc["files"]] == ["a_gsm8k_b1.jsonl"]
