"""Invalid ``--speculative-config`` per method (issue 9, item 1): a config-load error naming the field, through
every door: ``ServeArgs`` (``serve deploy`` / ``build_app``), a Serve config file given to ``flexspec serve``
(exit code 2 before Ray starts), ``flexspec serve --speculative-config`` and ``flexspec generate
--speculative-config``."""

from __future__ import annotations

import json

import pytest
import yaml
from pydantic import ValidationError
from typer.testing import CliRunner

from configs.serve import ServeArgs
from flexspec.cli import app

CASES = [
    ("ngram", {"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ("ngram", {"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ("ngram", {"method": "ngram", "prompt_lookup_max": 0}, "prompt_lookup_max"),
    ("ngram", {"method": "ngram", "model": "x"}, "model"),  # ngram takes no model: unknown field
    ("draft_model", {"method": "draft_model"}, "model"),
    ("draft_model", {"method": "draft_model", "model": "m", "num_speculative_tokens": 65}, "num_speculative_tokens"),
    ("draft_model", {"method": "draft_model", "model": "m", "draft_tensor_parallel_size": 3}, "draft_tensor_parallel_size"),
    ("dflash", {"method": "dflash"}, "model"),
    ("dflash", {"method": "dflash", "model": "m", "num_speculative_tokens": "many"}, "num_speculative_tokens"),
    ("dspark", {"method": "dspark", "model": "m", "confidence_threshold": 1.5}, "confidence_threshold"),
    ("eagle3", {"method": "eagle3"}, "model"),
    ("eagle3", {"method": "eagle3", "model": "m", "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ("mtp", {"method": "mtp", "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ("mtp", {"method": "mtp", "execution": "sideways"}, "execution"),
    ("flexdraft", {"method": "flexdraft"}, "model"),
    ("flexdraft", {"method": "flexdraft", "model": "m", "verification_threshold": -0.1}, "verification_threshold"),
    ("flexdraft", {"method": "flexdraft", "model": "m", "execution": "parallel", "bogus": 1}, "bogus"),
    ("unknown", {"method": "medusa"}, "method"),
    ("missing", {"num_speculative_tokens": 3}, "method"),
]  # fmt: skip
IDS = [f"{method}-{field}-{i}" for i, (method, _, field) in enumerate(CASES)]


@pytest.mark.parametrize(("method", "spec", "field"), CASES, ids=IDS)
def test_serve_args_name_the_field(method, spec, field):
    with pytest.raises(ValidationError) as e:
        ServeArgs.model_validate({"speculative_config": spec})
    assert field in str(e.value)
    assert "speculative_config" in str(e.value)


@pytest.mark.parametrize(("method", "spec", "field"), CASES, ids=IDS)
def test_flexspec_serve_rejects_the_config_file(tmp_path, method, spec, field):
    path = tmp_path / "serve.yaml"
    config = {
        "applications": [
            {
                "name": "x",
                "route_prefix": "/",
                "import_path": "cluster.app:build_app",
                "args": {"engine": {"device": "cpu"}, "speculative_config": spec},
            }
        ]
    }
    path.write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(app, ["serve", "--config", str(path)])
    assert result.exit_code == 2, result.output
    assert "applications.0.args" in result.output and "speculative_config" in result.output
    assert field in result.output


@pytest.mark.parametrize(("method", "spec", "field"), CASES, ids=IDS)
def test_flexspec_generate_rejects_the_speculative_config(method, spec, field):
    result = CliRunner().invoke(
        app, ["generate", "hi", "--device", "cpu", "--speculative-config", json.dumps(spec)]
    )
    assert result.exit_code == 2, result.output
    assert field in result.output


def test_not_json_is_rejected_too():
    result = CliRunner().invoke(app, ["generate", "hi", "--speculative-config", "{method: ngram"])
    assert result.exit_code == 2 and "not valid JSON" in result.output


@pytest.mark.parametrize(("method", "spec", "field"), CASES, ids=IDS)
def test_flexspec_serve_rejects_the_speculative_config_option(monkeypatch, method, spec, field):
    import cluster.launcher

    def must_not_start(*args, **kwargs):
        raise AssertionError("an invalid --speculative-config must fail before Ray starts")

    monkeypatch.setattr(cluster.launcher, "serve_forever", must_not_start)
    result = CliRunner().invoke(app, ["serve", "--speculative-config", json.dumps(spec)])
    assert result.exit_code == 2, result.output
    # a field of its own is named after the option; a clash with the file's settings (the drafter's TP vs the
    # target's) after the file's field, with the value from the option
    assert result.output.startswith("error: --speculative-config") or (
        f"speculative_config.{field}" in result.output
    ), result.output
    assert field in result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("{method: ngram", "error: --speculative-config is not valid JSON"),
        ('"ngram"', "error: --speculative-config: expected a JSON object or null, got str"),
        (
            '{"method": "flexdraft", "model": "no-such-drafter"}',
            "error: --speculative-config.model: unknown model 'no-such-drafter'",
        ),
    ],
    ids=["not-json", "not-object", "unknown-drafter"],
)
def test_flexspec_serve_speculative_config_option_not_json_or_unknown_drafter(monkeypatch, spec, message):
    import cluster.launcher

    monkeypatch.setattr(cluster.launcher, "serve_forever", lambda *a, **k: pytest.fail("Ray started"))
    result = CliRunner().invoke(app, ["serve", "--speculative-config", spec])
    assert result.exit_code == 2 and result.output.startswith(message), result.output
