"""Bad input on the command line (issue 9's standard): every subcommand answers with one ``error:`` line naming
the field or value and a non-zero exit code, never a Python traceback. None of these starts Ray."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from flexspec.cli import app
from tests.conftest import DEFAULT_MODEL

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
no_cuda = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="checks the no-GPU error message; runs on CPU machines (CI), not on the H200",
)


def _run(args: list[str]):
    result = CliRunner().invoke(app, args)
    assert "Traceback" not in result.output, result.output
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), (
        f"{type(result.exception).__name__}: {result.exception}"
    )
    return result


def _default_config() -> dict:
    return yaml.safe_load((CONFIGS / "serve.yaml").read_text())


BAD_CONFIG_IDS = ["unclosed", "double-comma", "top-list", "apps-mapping", "app-string", "port-range", "port-type",
                  "ray-field", "http-typo", "top-typo", "app-typo", "grpc-typo", "deployment-typo"]  # fmt: skip


# ---- flexspec serve: the config file --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("applications:\n  - name: x\n    args: {engine: [\n", "invalid YAML at line 4"),
        ("applications: [\n  {name: x,, }]\n", "invalid YAML at line 2"),
        ("- a\n- b\n", "expected a mapping"),
        ("applications: {name: x}\n", "applications: expected a list"),
        ("applications:\n  - just-a-string\n", "applications.0: expected a mapping"),
        ("http_options: {port: 70000}\napplications: []\n", "http_options.port: 70000"),
        ("http_options: {port: abc}\napplications: []\n", "http_options.port"),
        ("applications: []\nproxy_location: Nowhere\n", "proxy_location"),
        ("http_options: {prot: 8011}\napplications: []\n", "http_options.prot: unknown field"),
        ("applications: []\nfoo: 1\n", "foo: unknown field"),
        (
            "applications:\n  - {name: x, import_path: a:b, route_prefx: /}\n",
            "applications.0.route_prefx: unknown",
        ),
        ("grpc_options: {prt: 9100}\napplications: []\n", "grpc_options.prt: unknown field"),
        (
            "applications:\n  - {name: x, import_path: a:b, deployments: [{name: D, num_replica: 3}]}\n",
            "applications.0.deployments.0.num_replica: unknown field",
        ),
    ],
    ids=BAD_CONFIG_IDS,
)
def test_serve_rejects_bad_config_files(tmp_path, text, expected):
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    result = _run(["serve", "--config", str(path)])
    assert result.exit_code == 2, result.output
    assert expected in result.output and str(path) in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_serve_rejects_unreadable_config(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_bytes(b"\xff\xfe\x00bad")
    result = _run(["serve", "--config", str(path)])
    assert result.exit_code == 2 and "cannot read" in result.output


@pytest.mark.parametrize(
    ("port", "expected"), [("70000", "65535"), ("0", "--port"), ("abc", "--port"), ("-1", "--port")]
)
def test_serve_rejects_bad_port_option(port, expected):
    result = _run(["serve", "--config", str(CONFIGS / "serve.yaml"), "--port", port])
    assert result.exit_code == 2, result.output
    assert expected in result.output


@pytest.mark.parametrize(
    ("edit", "field", "value"),
    [
        (lambda a: a.update(model="no-such-model"), "applications.0.args.model", "no-such-model"),
        (
            lambda a: a.pop("model") and a["engine"].update(model="/nonexistent/model.gguf"),
            "applications.0.args.engine.model",
            "/nonexistent/model.gguf",
        ),
        (
            lambda a: a["speculative_config"].update(model="no-such-drafter"),
            "applications.0.args.speculative_config.model",
            "no-such-drafter",
        ),
    ],
    ids=["model", "engine-model-path", "drafter"],
)
def test_serve_rejects_unknown_models_before_ray_starts(tmp_path, edit, field, value):
    config = _default_config()
    edit(config["applications"][0]["args"])
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    result = _run(["serve", "--config", str(path)])
    assert result.exit_code == 2, result.output
    assert f"{field}: unknown model {value!r}" in result.output


def test_serve_rejects_a_context_past_the_model_before_ray_starts(tmp_path):
    """Was: Ray started, the replica failed 3 times on the engine's ConfigError, exit 1 after ~a minute."""
    config = _default_config()
    config["applications"][0]["args"]["engine"]["max_model_len"] = 1_000_000
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    result = _run(["serve", "--config", str(path)])
    assert result.exit_code == 2, result.output
    assert (
        "applications.0.args.engine.max_model_len: 1000000 exceeds the model's max_position_embeddings 8192"
        in result.output
    )


def test_serve_names_the_model_whose_config_is_incomplete(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(b"")
    config = _default_config()
    config["applications"][0]["args"]["model"] = str(folder)
    config["applications"][0]["args"]["speculative_config"] = None
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    result = _run(["serve", "--config", str(path)])
    assert result.exit_code == 2, result.output
    assert "applications.0.args.model: the model's config.json cannot be read" in result.output


def test_serve_checks_models_only_for_its_own_cluster(tmp_path, monkeypatch):
    """With --address the replicas run elsewhere, where the path may exist: no local model check."""
    import cluster.launcher

    config = _default_config()
    config["applications"][0]["args"]["model"] = "/models/only-on-the-cluster"
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.setattr(cluster.launcher, "serve_forever", lambda *a, **k: 0)
    assert _run(["serve", "--config", str(path), "--address", "auto"]).exit_code == 0


def test_parallel_execution_of_a_non_flexdraft_method_fails_at_load():
    spec = '{"method": "ngram", "execution": "parallel"}'
    result = _run(["generate", "hi", "--device", "cpu", "--speculative-config", spec])
    assert result.exit_code == 2 and "execution 'parallel' needs method 'flexdraft'" in result.output


# ---- generate / bench / train-drafter: settings the engine cannot satisfy ---------------------------------------
@no_cuda
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--max-tokens", "0"], "--max-tokens: Input should be greater than 0"),
        (["--top-p", "1.5"], "--top-p: Input should be less than or equal to 1"),
        (["--temperature", "-1"], "--temperature: Input should be greater than or equal to 0"),
        (["--max-model-len", "0"], "--max-model-len: Input should be greater than 0"),
        (
            ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
            "--speculative-config.num_speculative_tokens: Input should be greater than or equal to 1",
        ),
        (
            ["--speculative-config", "{}"],
            "--speculative-config: missing 'method' (one of: dflash, draft_model, dspark, eagle3, flexdraft, "
            + "mtp, ngram)",
        ),
        (
            ["--speculative-config", '{"method": "medusa"}'],
            "--speculative-config: unknown method 'medusa' (one of: dflash, draft_model, dspark, eagle3, "
            + "flexdraft, mtp, ngram)",
        ),
        (  # a check across fields, named at the option (no pydantic "(root): Value error, ")
            ["--speculative-config", '{"method": "ngram", "draft_tensor_parallel_size": 3}'],
            "--speculative-config: draft_tensor_parallel_size must be 1 or the target's tensor_parallel_size (1), "
            + "got 3",
        ),
    ],
    ids=[
        "max-tokens",
        "top-p",
        "temperature",
        "max-model-len",
        "speculative-config",
        "no-method",
        "bad-method",
        "draft-tp",
    ],
)
def test_generate_names_the_option_of_an_invalid_setting(args, expected):
    """As ``flexspec serve`` names ``--speculative-config``: the option the user typed, not the config field."""
    result = _run(["generate", "hi", "--device", "cpu", *args])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == f"error: {expected}"


@pytest.mark.parametrize(
    ("args", "field", "model"),
    [
        (["--model", "no-such-model"], "--model", "no-such-model"),
        (
            ["--speculative-config", '{"method": "flexdraft", "model": "no-such-drafter"}'],
            "--speculative-config.model",
            "no-such-drafter",
        ),
    ],
    ids=["target", "drafter"],
)
def test_generate_names_the_option_of_an_unknown_model(args, field, model):
    """As ``flexspec serve``: an unknown model is named after the option that set it, before anything loads."""
    result = _run(["generate", "hi", "--device", "cpu", *args])
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert (
        line.startswith(f"error: {field}: unknown model {model!r}: not a built-in id (") and "\n" not in line
    )


@pytest.mark.parametrize("option", ["--model", "--speculative-config.model"])
def test_generate_names_the_option_of_a_folder_without_config(tmp_path, option):
    """An existing folder that is no checkpoint (no config.json) is named after its option, before loading."""
    args = ["--model", str(tmp_path)]
    if option != "--model":
        args = ["--speculative-config", json.dumps({"method": "dflash", "model": str(tmp_path)})]
    result = _run(["generate", "hi", "--device", "cpu", *args])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == (
        f"error: {option}: model {str(tmp_path)!r} is a folder without config.json "
        "(a checkpoint folder holds config.json and *.safetensors)"
    )


def test_generate_device_cuda_without_cuda():
    result = _run(["generate", "hi", "--device", "cuda"])
    assert result.exit_code == 2
    assert result.output.strip() == "error: device='cuda' but no CUDA/ROCm device is visible"


def test_generate_rejects_a_prompt_that_is_not_utf8():
    result = _run(["generate", "\udcff\udcfe", "--device", "cpu"])  # bytes ff fe as the shell passes them
    assert (
        result.exit_code == 2
        and result.output.strip() == "error: prompt is not valid UTF-8 text (position 0)"
    )


def test_generate_max_model_len_past_the_model():
    result = _run(["generate", "hi", "--device", "cpu", "--max-model-len", "100000"])
    assert result.exit_code == 2 and "max_model_len 100000 exceeds" in result.output


@pytest.fixture(scope="module")
def replica_8():
    """The server's replica class in-process (no Ray) with an 8-token context, as `generate` below uses."""
    from cluster.server import LLMServer
    from flexspec.engine.llm_engine import LLMEngine

    args = {"model": DEFAULT_MODEL, "served_model_name": "m", "engine": {"device": "cpu", "max_model_len": 8}}
    server = LLMServer(args, engine_factory=lambda a: LLMEngine(a.engine))
    yield server
    server.controller.stop()


def _completion_chunks(server, body: dict) -> list[dict]:
    async def collect() -> list[dict]:
        return [chunk async for chunk in server.completion(body)]

    return asyncio.run(collect())


GENERATE_8 = ["--no-chat", "--device", "cpu", "--max-model-len", "8"]  # the context of ``replica_8``


# "hi" without the chat template is one token of SmolLM2's tokenizer; "hi hi ... hi" (8 words) is eight.
@pytest.mark.parametrize(
    ("prompt", "max_tokens", "expected"),
    [
        (
            "hi",
            8,
            (
                "This model's maximum context length is 8 tokens. However, you requested 9 tokens (1 in the "
                "prompt, 8 for the completion)."
            ),
        ),
        (
            " ".join(["hi"] * 8),
            1,
            (
                "This model's maximum context length is 8 tokens; the prompt has 8 tokens, which leaves no room "
                "for output."
            ),
        ),
    ],
    ids=["prompt-plus-max-tokens", "prompt-alone"],
)
def test_generate_rejects_what_does_not_fit_as_the_server_does(replica_8, prompt, max_tokens, expected):
    """The server's 400 with its message, not a completion cut short with finish reason "length"."""
    chunks = _completion_chunks(replica_8, {"model": "m", "prompt": prompt, "max_tokens": max_tokens})
    assert [c.get("status") for c in chunks] == [400], chunks
    assert chunks[0]["error"]["message"] == expected
    result = _run(["generate", prompt, *GENERATE_8, "--max-tokens", str(max_tokens)])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == f"error: {expected}"


def test_generate_accepts_a_prompt_that_fills_the_context_exactly():
    result = _run(["generate", "hi", *GENERATE_8, "--max-tokens", "7", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["num_prompt_tokens"] == 1 and 1 <= out["num_output_tokens"] <= 7


@no_cuda
def test_bench_device_cuda_without_cuda():
    result = _run(["bench", "engine", "--device", "cuda"])
    assert result.exit_code == 2 and "device='cuda'" in result.output


def test_bench_json_option_that_is_not_json():
    result = _run(["bench", "synthetic", "--profile", "abc"])
    assert result.exit_code == 2 and "not valid JSON" in result.output


def test_train_drafter_unknown_target(tmp_path):
    result = _run(
        ["train-drafter", "--method", "flexdraft", "--output", str(tmp_path / "run"), "--target", "nope"]
    )
    assert result.exit_code == 2 and "unknown model 'nope'" in result.output


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("FLEXSPEC_SPLIT_KV", "3"),
        ("FLEXSPEC_FUSED_DECODE", "maybe"),
        ("FLEXSPEC_SKINNY_LINEAR", "fast"),
        ("FLEXSPEC_PDL", "sometimes"),
    ],
)
def test_generate_reports_a_bad_environment_setting_in_one_line(var, value):
    """FLEXSPEC_* variables are read when the engine's modules are imported (a fresh process here): a bad value
    is one ``error:`` line naming the variable, exit code 2, no traceback."""
    import os
    import subprocess
    import sys

    env = {**os.environ, var: value}
    proc = subprocess.run(
        [sys.executable, "-c", "from flexspec.cli import app; app()", "generate", "hi", "--max-tokens", "2",
         "--device", "cpu"],
        check=False, capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and var in proc.stderr, proc.stderr[-2000:]
    assert [ln for ln in proc.stderr.splitlines() if ln.strip()][-1].startswith("error:"), proc.stderr[-2000:]
