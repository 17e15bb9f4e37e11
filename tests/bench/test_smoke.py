"""CPU smoke run of the benchmark harness (issue 7): tiny N, real prompts, plain vs n-gram in one run, plus the
transformers peer, plots and the synthetic projection on a tiny shape. Checks that the JSON fields exist and
are sane, not the speed."""

from __future__ import annotations

import json
import random

import pytest

from bench import spec_bench, synthetic
from bench.server_bench import parse_prometheus, server_spec_delta

K = 3


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "results.json"
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3})
    doc = spec_bench.main([
        "--dataset", "gsm8k", "--num-prompts", "2", "--batch-sizes", "1,2", "--max-tokens", "8",
        "--max-prompt-len", "64", "--max-model-len", "256", "--device", "cpu", "--warmup", "0",
        "--speculative-config", spec, "--peer", "hf", "--output", str(out), "--no-progress",
    ])  # fmt: skip
    assert json.loads(out.read_text())["runs"] == doc["runs"]  # the file holds what main returned
    return doc


def _runs(doc: dict, system: str) -> dict[int, dict]:
    return {r["batch_size"]: r for r in doc["runs"] if r["system"] == system}


def test_environment_recorded(smoke):
    env = smoke["env"]
    assert env["versions"]["torch"] and env["versions"]["transformers"]
    assert env["machine"]["cpu"] and env["command"]
    assert "git_commit" in env
    assert smoke["config"]["model_dir"] and smoke["config"]["temperature"] == 0.0
    assert not smoke["errors"]


def test_plain_and_ngram_points(smoke):
    plain, ngram = _runs(smoke, "plain"), _runs(smoke, f"ngram-k{K}")
    assert set(plain) == set(ngram) == {1, 2}
    for b in (1, 2):
        p, s = plain[b], ngram[b]
        assert p["output_tokens"] == s["output_tokens"] == 2 * 8 or p["output_tokens"] == s["output_tokens"]
        assert p["output_tokens_per_s"] > 0 and s["output_tokens_per_s"] > 0
        assert s["throughput_ratio"] > 0 and s["baseline"] == "plain"
        sd = s["spec_decode"]
        assert sd["mean_acceptance_length"] >= 1.0
        assert 0.0 <= sd["acceptance_rate"] <= 1.0
        assert len(sd["per_position_acceptance"]) == K
        assert all(0.0 <= x <= 1.0 for x in sd["per_position_acceptance"])
        assert s["matches_plain"] == 1.0  # greedy speculative output == plain output (fp32)
        split = s["step_time"]["decode_steps"] or s["step_time"]["all_steps"]
        assert split["step_ms"] > 0 and split["draft_ms"] >= 0 and split["verify_ms"] > 0
        for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
            lat = s["latency"][key]
            assert lat["p50"] > 0 and lat["p99"] >= lat["p50"]


def test_transformers_peer(smoke):
    hf = _runs(smoke, "hf_dynamic")
    assert set(hf) == {1, 2}
    assert all(r["output_tokens_per_s"] > 0 and r["ratio_vs_flexspec_plain"] > 0 for r in hf.values())


def test_plots(smoke, tmp_path):
    pytest.importorskip("matplotlib")
    from bench.plots import make_plots

    paths = make_plots([smoke], tmp_path)
    names = {p.rsplit("/", 1)[-1] for p in paths}
    assert {"speedup_vs_batch.png", "per_position_acceptance.png", "mal_vs_k.png"} <= names


def test_expand_configs_sweep_and_labels():
    systems = spec_bench.expand_configs(
        ['[{"method": "ngram"}, {"method": "ngram", "label": "ng2", "prompt_lookup_max": 2}]'], [1, 3]
    )
    assert [s["label"] for s in systems] == ["ngram-k1", "ngram-k3", "ng2-k1", "ng2-k3"]
    assert [s["num_speculative_tokens"] for s in systems] == [1, 3, 1, 3]
    with pytest.raises(SystemExit):
        spec_bench.expand_configs(['{"method": "ngram", "num_speculative_tokens": 0}'], None)


def test_replayed_acceptance_matches_profile():
    profile = [0.8, 0.6, 0.3]
    rng = random.Random(0)
    draws = [synthetic.sample_accepted(profile, rng) for _ in range(20000)]
    for i, p in enumerate(profile, start=1):
        assert abs(sum(a >= i for a in draws) / len(draws) - p) < 0.02


def test_synthetic_projection_tiny(tmp_path):
    doc = synthetic.main([
        "--profile", "[0.8, 0.5]", "--shape", "tiny", "--batch-sizes", "1,2", "--steps", "2",
        "--context-len", "32", "--device", "cpu", "--output", str(tmp_path / "synth.json"),
    ])  # fmt: skip
    assert doc["projection"] is True and "PROJECTION" in doc["note"]
    for pt in doc["points"]:
        assert pt["projected_throughput_ratio"] > 0 and pt["replayed_mal"] >= 1.0


def test_server_metrics_parsing():
    before = parse_prometheus('vllm:spec_decode_num_drafts_total{engine="0"} 10\n')
    after = parse_prometheus(
        "# HELP x\n"
        'vllm:spec_decode_num_drafts_total{engine="0"} 20\n'
        'vllm:spec_decode_num_draft_tokens_total{engine="0"} 30\n'
        'vllm:spec_decode_num_accepted_tokens_total{engine="0"} 15\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 9\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 6\n'
    )
    d = server_spec_delta(before, after)
    assert d["num_drafts"] == 10 and d["mean_acceptance_length"] == 2.5
    assert d["per_position_acceptance"] == [0.9, 0.6]
