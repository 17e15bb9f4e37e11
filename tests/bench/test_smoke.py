"""CPU smoke run of the benchmark harness (issue 7): tiny N, real prompts, plain vs n-gram in one run, plus the
transformers peer, plots and the synthetic projection on a tiny shape. Checks that the JSON fields exist and
are sane, not the speed."""

from __future__ import annotations

import json
import random
import time

import pytest

from bench import spec_bench, synthetic
from bench.common import source_digest
from bench.server_bench import parse_prometheus, server_spec_delta

K = 3


@pytest.fixture(scope="module")
def smoke_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bench")


@pytest.fixture(scope="module")
def smoke(smoke_dir) -> dict:
    import torch

    out = smoke_dir / "results.json"
    # decoupled: always speculate (auto may measure plain decoding as faster on 8 tokens and never draft)
    spec = json.dumps(
        {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "execution": "decoupled"}
    )
    threads = torch.get_num_threads()
    try:  # one thread: robust on a shared 2-core machine (oversubscribed OpenMP threads thrash)
        doc = spec_bench.main(
            [
                "--dataset",
                "gsm8k",
                "--num-prompts",
                "2",
                "--batch-sizes",
                "1,2",
                "--max-tokens",
                "8",
                "--max-prompt-len",
                "64",
                "--max-model-len",
                "256",
                "--device",
                "cpu",
                "--warmup",
                "0",
                "--cpu-threads",
                "1",
                "--speculative-config",
                spec,
                "--peer",
                "hf",
                "--output",
                str(out),
                "--step-log",
                str(smoke_dir / "steps"),
                "--no-progress",
            ]
        )
    finally:
        torch.set_num_threads(threads)
    assert json.loads(out.read_text())["runs"] == doc["runs"]  # the file holds what main returned
    return doc


def _runs(doc: dict, system: str) -> dict[int, dict]:
    return {r["batch_size"]: r for r in doc["runs"] if r["system"] == system}


def test_environment_recorded(smoke):
    env = smoke["env"]
    assert env["versions"]["torch"] and env["versions"]["transformers"]
    assert env["machine"]["cpu"] and env["command"]
    assert "git_commit" in env
    assert env["source_sha256"] == source_digest() and len(env["source_sha256"]) == 16
    assert smoke["config"]["model_dir"] and smoke["config"]["temperature"] == 0.0
    assert smoke["config"]["prepare_s"] >= 0.0  # the time budget counts from the prepared model
    assert not smoke["errors"]


def test_plain_and_ngram_points(smoke):
    plain, ngram = _runs(smoke, "plain"), _runs(smoke, f"ngram-k{K}")
    assert set(plain) == set(ngram) == {1, 2}
    for b in (1, 2):
        p, s = plain[b], ngram[b]
        assert 0 < p["output_tokens"] == s["output_tokens"] <= 2 * 8  # same tokens: lossless at T=0
        assert p["output_tokens_per_s"] > 0 and s["output_tokens_per_s"] > 0
        assert s["throughput_ratio"] > 0 and s["baseline"] == "plain"
        sd = s["spec_decode"]
        assert sd["mean_acceptance_length"] >= 1.0
        assert 0.0 <= sd["acceptance_rate"] <= 1.0
        assert len(sd["per_position_acceptance"]) == K
        assert all(0.0 <= x <= 1.0 for x in sd["per_position_acceptance"])
        assert s["matches_plain"] == 1.0  # greedy speculative output == plain output (fp32)
        # which graphs ran is recorded; on CPU none are captured
        assert (
            p["cuda_graphs"]
            == s["cuda_graphs"]
            == {
                "decode_graph_query_lens": [],
                "mixed_graph_num_tokens": None,
                "skinny_max_rows": 0,
                "skinny_timing_us": {},
            }  # CPU: no graphs, no skinny GEMMs (not measured)
        )
        split = s["step_time"]["decode_steps"] or s["step_time"]["all_steps"]
        assert split["step_ms"] > 0 and split["draft_ms"] >= 0 and split["verify_ms"] > 0
        for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
            lat = s["latency"][key]
            assert lat["p50"] > 0 and lat["p99"] >= lat["p50"]


def test_step_log_and_split_by_mode(smoke, smoke_dir):
    """--step-log writes one JSON line per step of each point, the same steps the point's step-time split
    summarizes; a speculative system's split is also given per mode of the policy."""
    for system in ("plain", f"ngram-k{K}"):
        for b, point in _runs(smoke, system).items():
            path = smoke_dir / "steps" / f"{system}_gsm8k_b{b}.jsonl"
            steps = [json.loads(line) for line in path.read_text().splitlines()]
            split = point["step_time"]
            assert len(steps) == split["all_steps"]["num_steps"] > 0
            assert sum(s["decode"] for s in steps) == (split["decode_steps"] or {"num_steps": 0})["num_steps"]
            assert all(s["wall_ms"] > 0 and 1 <= s["num_seqs"] <= b and s["round"] == 0 for s in steps)
            # every point prefills its prompts: the call that prefills (and starts the next step) is no decode step
            assert not steps[0]["decode"] and steps[0]["num_launched"] >= 1
            modes = {s["mode"] for s in steps}
            if system == "plain":
                assert modes == {"plain"} and "by_mode" not in split
                assert {s["reason"] for s in steps} == {""}  # no policy
            else:  # always decoupled: every step drafts, as configured (not the policy's choice)
                assert modes == {"decoupled"} and {s["reason"] for s in steps} == {"fixed"}
                assert split["by_mode"]["decoupled"]["all_steps"]["num_steps"] == len(steps)


def test_step_log_folder_is_checked_before_measuring(tmp_path, capsys):
    """A --step-log path that is a file, or a folder holding an earlier run's logs, fails at once (usage error)."""
    (tmp_path / "afile").write_text("x")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "plain_gsm8k_b1.jsonl").write_text("{}\n")
    for bad, why in ((tmp_path / "afile", "is a file"), (tmp_path / "old", "earlier run")):
        with pytest.raises(SystemExit) as e:
            spec_bench.main(["--device", "cpu", "--step-log", str(bad), "--output", str(tmp_path / "r.json")])
        assert e.value.code == 2 and why in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # server mode has no engine steps to log
        spec_bench.main(["--mode", "server", "--step-log", str(tmp_path / "new"), "--url", "a=http://x"])
    assert e.value.code == 2 and "engine mode only" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()  # nothing was measured


def test_repeats_interleave_systems_and_report_the_median_round(tmp_path):
    """--repeats 3: every point runs 3 rounds of all systems; the point is the median round (by tokens/s), the
    rounds' tokens/s are kept, and every round of the lossless speculative system matches plain decoding."""
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 2, "execution": "decoupled"})
    doc = spec_bench.main(
        ["--dataset", "gsm8k", "--num-prompts", "1", "--batch-sizes", "1", "--max-tokens", "6",
         "--max-prompt-len", "64", "--max-model-len", "256", "--device", "cpu", "--warmup", "0",
         "--repeats", "3", "--speculative-config", spec, "--no-progress", "--output", str(tmp_path / "r.json")]
    )  # fmt: skip
    runs = {r["system"]: r for r in doc["runs"]}
    assert set(runs) == {"plain", "ngram-k2"} and not doc["errors"]
    for r in runs.values():
        rounds = r["repeats_tokens_per_s"]
        assert len(rounds) == 3 and r["output_tokens_per_s"] == sorted(rounds)[1]
    assert runs["ngram-k2"]["repeats_matches_plain"] == [1.0, 1.0, 1.0]
    assert runs["ngram-k2"]["throughput_ratio"] == pytest.approx(
        runs["ngram-k2"]["output_tokens_per_s"] / runs["plain"]["output_tokens_per_s"], rel=1e-3
    )
    spec_rounds, plain_rounds = (runs[k]["repeats_tokens_per_s"] for k in ("ngram-k2", "plain"))
    paired = [x / y for x, y in zip(spec_rounds, plain_rounds)]  # round i of both ran back to back
    assert runs["ngram-k2"]["paired_ratios"] == pytest.approx(paired, abs=1e-4)
    assert runs["ngram-k2"]["paired_ratio_median"] == pytest.approx(sorted(paired)[1], abs=1e-4)
    assert runs["plain"]["paired_ratios"] == [1.0, 1.0, 1.0]


def test_paired_ratios_need_the_same_rounds():
    assert spec_bench._paired_ratios([2.0, 3.0], [1.0, 2.0]) == [2.0, 1.5]
    for xs, base in [(None, [1.0, 2.0]), ([2.0], [1.0]), ([2.0, 3.0], [1.0]), ([2.0, 3.0], [1.0, 0.0])]:
        assert spec_bench._paired_ratios(xs, base) is None


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
    # without a sweep an explicit label is the system's name as given (not "auto-k15"); repeats are numbered
    systems = spec_bench.expand_configs(
        [
            '{"method": "ngram", "label": "auto"}',
            '{"method": "ngram"}',
            '{"method": "ngram", "label": "auto"}',
        ],
        None,
    )
    assert [s["label"] for s in systems] == ["auto", "ngram-k5", "auto-2"]
    with pytest.raises(
        SystemExit, match=r"^error: invalid speculative config .*num_speculative_tokens: Input"
    ) as e:
        spec_bench.expand_configs(['{"method": "ngram", "num_speculative_tokens": 0}'], None)
    assert "\n" not in str(e.value)  # one line, the field named (not pydantic's validator dump)


def test_replayed_acceptance_matches_profile():
    profile = [0.8, 0.6, 0.3]
    rng = random.Random(0)
    draws = [synthetic.sample_accepted(profile, rng) for _ in range(20000)]
    for i, p in enumerate(profile, start=1):
        assert abs(sum(a >= i for a in draws) / len(draws) - p) < 0.02


def test_synthetic_projection_tiny(tmp_path):
    doc = synthetic.main(
        [
            "--profile",
            "[0.8, 0.5]",
            "--shape",
            "tiny",
            "--batch-sizes",
            "1,2",
            "--steps",
            "2",
            "--context-len",
            "32",
            "--device",
            "cpu",
            "--output",
            str(tmp_path / "synth.json"),
        ]
    )
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


def _fake_openai_server():
    """A stand-in OpenAI-compatible server: streams 4 one-token chunks + usage; exports spec counters."""
    import threading
    import time as _time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    state = {"drafts": 0}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet
            pass

        def _send(self, body: bytes, ctype: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/v1/models":
                self._send(json.dumps({"data": [{"id": "fake"}]}).encode(), "application/json")
            else:
                d = state["drafts"]
                self._send(
                    (
                        f"vllm:spec_decode_num_drafts_total {d}\nvllm:spec_decode_num_draft_tokens_total {3 * d}\n"
                        f"vllm:spec_decode_num_accepted_tokens_total {d}\n"
                    ).encode(),
                    "text/plain",
                )

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            chat = self.path.endswith("chat/completions")
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for _ in range(4):
                choice = {"delta": {"content": "x"}} if chat else {"text": "x"}
                self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
                self.wfile.flush()
                _time.sleep(0.002)
            state["drafts"] += 2
            usage = {"choices": [], "usage": {"completion_tokens": 4, "prompt_tokens": 3}}
            self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
            assert body["stream"] and body["stream_options"]["include_usage"]

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_server_mode_against_fake_server(tmp_path):
    pytest.importorskip("httpx")
    server = _fake_openai_server()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        doc = spec_bench.main(
            [
                "--mode",
                "server",
                "--url",
                f"a={url}",
                "--url",
                f"b={url}",
                "--dataset",
                "gsm8k,humaneval",
                "--num-prompts",
                "3",
                "--batch-sizes",
                "1,2",
                "--max-tokens",
                "4",
                "--no-progress",
                "--output",
                str(tmp_path / "server.json"),
            ]
        )
    finally:
        server.shutdown()
    runs = [r for r in doc["runs"] if r["mode"] == "server"]
    assert len(runs) == 2 * 2 * 2 and not doc["errors"]
    for r in runs:
        assert r["num_errors"] == 0 and r["output_tokens"] == 4 * r["num_requests"]
        assert r["throughput_ratio"] > 0 and r["baseline"] == "a"
        assert r["latency"]["ttft_ms"]["p50"] > 0 and r["latency"]["itl_ms"]["count"] == 3 * r["num_requests"]
        assert r["spec_decode"]["mean_acceptance_length"] >= 1.0


def test_engine_bench_summary_targets():
    from bench.engine_bench import summarize

    doc = {
        "results": {
            "flexspec": {
                "1": {"output_tokens_per_s": 400.0, "token_ids": [[1, 2, 3, 4]]},
                "32": {"output_tokens_per_s": 9000.0},
            },
            "hf_dynamic": {
                "1": {"output_tokens_per_s": 20.0, "token_ids": [[1, 2, 9, 9]]},
                "32": {"output_tokens_per_s": 400.0},
            },
            "hf_static_compile": {"1": {"output_tokens_per_s": 100.0}, "32": {"error": "boom"}},
        },
        "decode_step_batch1": {"engine_step_ms": 0.4, "forward_ms": 0.2},
    }
    s = summarize(doc, [1, 32])
    assert s["best_hf"]["1"]["system"] == "hf_static_compile" and s["speedup_vs_best_hf"]["1"] == 4.0
    assert s["speedup_vs_best_hf"]["32"] == 22.5
    assert s["token_agreement_with_hf_dynamic"]["1"] == 0.5
    assert s["targets"] == {
        "batch1_speedup_ge_3x": True,
        "batch32_speedup_ge_10x": True,
        "batch1_decode_step_le_0.5ms": True,
        "batch1_forward_le_0.5ms": True,
    }


def test_table_renders(smoke):
    from bench.table import render

    text = render([smoke])
    assert "| gsm8k | plain |" in text and f"ngram-k{K}" in text


def test_table_and_plot_report_paired_medians_of_rounds(tmp_path):
    """With ``--repeats`` a point's ratio is the median of its rounds' paired ratios, not the ratio of the two
    systems' median rounds (which for two rounds are each one's slower round)."""
    from bench.plots import plot_speedup
    from bench.spec_bench import add_ratios
    from bench.table import render

    def point(system, rounds):
        return {"mode": "engine", "dataset": "gsm8k", "system": system, "batch_size": 4,
                "output_tokens_per_s": min(rounds), "repeats_tokens_per_s": rounds}  # fmt: skip

    runs = [point("plain", [100.0, 80.0]), point("auto", [90.0, 96.0])]  # round ratios 0.90, 1.20
    add_ratios(runs)
    assert runs[1]["throughput_ratio"] == 1.125 and runs[1]["paired_ratio_median"] == 1.05
    doc = {"schema": "flexspec.bench.spec/1", "env": {}, "runs": runs}
    text = render([doc])
    assert "| gsm8k | auto | 1.05x |" in text and "median over the rounds" in text, text
    assert plot_speedup([doc], tmp_path).is_file()


def test_host_staging_tiny(tmp_path):
    from bench import host_staging

    out = tmp_path / "staging.json"
    host_staging.main(["--batch-sizes", "1,9", "--steps", "20", "--warmup", "2", "--max-model-len", "512",
                       "--output", str(out)])  # fmt: skip
    doc = json.loads(out.read_text())
    assert doc["env"]["machine"]["cpu_count"] >= 1
    assert [p["batch_size"] for p in doc["points"]] == [1, 9]
    for p in doc["points"]:
        for key in ("plain_graph_inputs_us", "verify_graph_inputs_us", "verify_fused_tail_rows_us"):
            assert p[key] > 0


def test_source_digest_names_the_code_that_ran(tmp_path):
    """``env.source_sha256``: which sources ran, where ``git_commit`` can be stale (a device copy's ``.git``)."""
    assert source_digest(tmp_path) is None
    (tmp_path / "flexspec").mkdir()
    (tmp_path / "flexspec" / "a.py").write_text("x = 1\n")
    (tmp_path / "flexspec" / "notes.txt").write_text("not code")
    first = source_digest(tmp_path)
    (tmp_path / "flexspec" / "notes.txt").write_text("still not code")
    assert source_digest(tmp_path) == first
    (tmp_path / "flexspec" / "a.py").write_text("x = 2\n")
    assert source_digest(tmp_path) != first
    (tmp_path / "flexspec" / "a.py").write_text("x = 1\n")
    assert source_digest(tmp_path) == first
    (tmp_path / "flexspec" / "a.py").rename(tmp_path / "flexspec" / "b.py")  # same content, other file
    assert source_digest(tmp_path) != first


def test_time_budget_counts_from_restart():
    """``--time-budget-s`` starts after the model is prepared (``Budget.restart``): a first load's GGUF
    dequantization (~30 s on a fresh machine) must not use up the measurements' budget."""
    from bench.common import Budget

    budget = Budget(0.05)
    time.sleep(0.06)
    assert budget.exhausted()
    assert budget.restart() >= 0.06 and not budget.exhausted()
    assert not Budget(0).exhausted()  # 0 = no budget
