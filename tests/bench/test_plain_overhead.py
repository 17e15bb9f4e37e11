"""bench.plain_overhead on a CPU with the stub model (host work only): interleaved rounds of a plain engine and
a speculative engine held on plain decoding, and a system that cannot be built fails the run, loudly."""

from __future__ import annotations

import json

import pytest

from bench import plain_overhead

DFLASH = '{"method": "dflash", "model": "smollm2-135m-instruct-dflash"}'
ARGS = [
    "--stub-model",
    "--device",
    "cpu",
    "--num-kv-blocks",
    "600",
    "--max-model-len",
    "512",
    "--profile-steps",
    "0",
]


def test_stub_rounds_interleave_systems(tmp_path, monkeypatch):
    calls: list[str] = []
    time_steps = plain_overhead.time_steps

    def counted(engine, steps):
        calls.append("spec" if engine.policy is not None else "plain")
        return time_steps(engine, steps)

    monkeypatch.setattr(plain_overhead, "time_steps", counted)
    out = tmp_path / "po.json"
    plain_overhead.main([*ARGS, "--batch-sizes", "3", "--steps", "4", "--repeats", "3",
                         "--speculative-config", DFLASH, "--output", str(out)])  # fmt: skip
    doc = json.loads(out.read_text())
    assert calls == ["plain", "spec", "spec", "plain", "plain", "spec"]  # rotated each round
    plain, spec = doc["points"]
    assert (plain["system"], spec["system"]) == ("plain", "dflash-k15")
    assert len(spec["wall_ms_rounds"]) == 3 and spec["wall_ms_per_step"] > 0
    assert spec["vs_plain"] == pytest.approx(spec["wall_ms_per_step"] / plain["wall_ms_per_step"], rel=1e-3)
    assert "errors" not in doc
    # the stub was removed: the runner samples for real again
    from flexspec.engine import model_runner
    from flexspec.engine.sampler import sample

    assert model_runner.sample is sample


def test_a_system_that_cannot_be_built_fails_the_run(tmp_path, capsys):
    out = tmp_path / "po.json"
    with pytest.raises(SystemExit) as exc:
        plain_overhead.main([*ARGS, "--batch-sizes", "2", "--steps", "2", "--output", str(out),
                             "--speculative-config", '{"method": "dflash", "model": "no-such-drafter"}'])  # fmt: skip
    assert exc.value.code == 1
    assert "no-such-drafter" in capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert [p["system"] for p in doc["points"]] == ["plain"] and doc["errors"][0]["system"]


def test_split_kv_systems_each_capture_their_own_setting(tmp_path, monkeypatch, capsys):
    from flexspec.layers import fused
    from flexspec_kernels import attention_split

    seen: list[tuple[str, bool]] = []
    from flexspec.engine import llm_engine  # plain_overhead imports LLMEngine inside main

    real = llm_engine.LLMEngine.__init__

    def init(self, *a, **kw):
        # what this engine's graphs would be captured with
        seen.append((attention_split.SPLIT_KV, fused.DECODE_FUSIONS))
        real(self, *a, **kw)

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", init)
    before = (attention_split.split_kv_setting(), fused.DECODE_FUSIONS)
    out = tmp_path / "po.json"
    plain_overhead.main([*ARGS, "--batch-sizes", "2", "--steps", "3", "--repeats", "2",
                         "--split-kv", "0,auto", "--output", str(out)])  # fmt: skip
    assert seen == [("0", before[1]), ("auto", before[1])]
    assert (attention_split.SPLIT_KV, fused.DECODE_FUSIONS) == before
    a, b = json.loads(out.read_text())["points"]
    assert (a["system"], b["system"]) == ("plain-split-kv-0", "plain-split-kv-auto")
    assert b["vs_plain"] == pytest.approx(b["wall_ms_per_step"] / a["wall_ms_per_step"], rel=1e-3)
    seen.clear()
    plain_overhead.main([*ARGS, "--batch-sizes", "1", "--steps", "2", "--fused-decode", "0,on",
                         "--output", str(out)])  # fmt: skip
    assert seen == [(before[0], False), (before[0], True)]
    assert (attention_split.SPLIT_KV, fused.DECODE_FUSIONS) == before
    points = json.loads(out.read_text())["points"]
    assert [p["system"] for p in points] == ["plain-fused-decode-0", "plain-fused-decode-1"]
    for bad, msg in (("maybe", "expected one of"), ("1,,0", "comma-separated"), ("", "comma-separated")):
        with pytest.raises(SystemExit) as exc:
            plain_overhead.main([*ARGS, "--fused-decode", bad])
        assert exc.value.code == 2 and msg in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        plain_overhead.main([*ARGS, "--split-kv", "3"])
    assert exc.value.code == 2 and "power of two" in capsys.readouterr().err
