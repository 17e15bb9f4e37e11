"""ServeArgs / Serve config files: presets load, bad fields fail at load naming the field, deployment options."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from cluster.app import build_app, llm_deployment_options
from cluster.launcher import load_serve_config
from configs.serve import ServeArgs

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PRESETS = sorted(CONFIGS.glob("serve*.yaml"))


def _args(path: Path) -> ServeArgs:
    return ServeArgs.model_validate(load_serve_config(path).applications[0].args)


def test_presets_exist_and_load():
    names = {p.name for p in PRESETS}
    assert {"serve.yaml", "serve-h200-tp1.yaml", "serve-h200-tp2.yaml", "serve-mi355x-tp8.yaml"} <= names
    for p in PRESETS:
        cfg = load_serve_config(p)
        assert cfg.applications[0].import_path == "cluster.app:build_app"
        build_app(cfg.applications[0].args)  # builds the Application graph (validates Serve options too)


def test_default_config_is_cpu_with_speculation():
    args = _args(CONFIGS / "serve.yaml")
    assert args.engine.model == "smollm2-135m-instruct" and args.engine.device == "cpu"
    assert args.engine.speculative_config is not None and args.engine.speculative_config.method == "dflash"
    assert args.engine.speculative_config.model == "smollm2-135m-instruct-dflash"
    opts = llm_deployment_options(args)
    assert "placement_group_bundles" not in opts  # TP=1: the replica is the rank
    assert opts["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 0}
    assert opts["autoscaling_config"]["max_replicas"] >= 1 and opts["max_queued_requests"] > 0


def test_gpu_presets_place_one_bundle_per_rank_strict_pack():
    tp2 = llm_deployment_options(_args(CONFIGS / "serve-h200-tp2.yaml"))
    assert tp2["placement_group_strategy"] == "STRICT_PACK"
    assert tp2["placement_group_bundles"] == [{"CPU": 4, "GPU": 1, "accelerator_type:H200": 0.001}] * 2
    assert tp2["ray_actor_options"] == {"num_cpus": 0}  # the replica rides in bundle 0
    mi = _args(CONFIGS / "serve-mi355x-tp8.yaml")
    assert mi.accelerator_type == "AMD-Instinct-MI355X-OAM" and mi.engine.tensor_parallel_size == 8
    bundles = llm_deployment_options(mi)["placement_group_bundles"]
    assert len(bundles) == 8 and all(b["accelerator_type:AMD-Instinct-MI355X-OAM"] > 0 for b in bundles)
    tp1 = llm_deployment_options(_args(CONFIGS / "serve-h200-tp1.yaml"))
    assert tp1["ray_actor_options"] == {"num_cpus": 4, "num_gpus": 1, "accelerator_type": "H200"}


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"engine": {"max_model_len": -1}}, "engine.max_model_len"),
        ({"bogus": 1}, "bogus"),
        ({"engine": {"dtype": "int3"}}, "engine.dtype"),
        ({"speculative_config": {"method": "nope"}}, "speculative_config"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 0}}, "num_speculative_tokens"),
        ({"deployment": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}}, "min_replicas"),
        ({"placement_strategy": "SPREAD"}, "placement_strategy"),
        (
            {
                "tensor_parallel_size": 4,
                "speculative_config": {"method": "ngram", "draft_tensor_parallel_size": 2},
            },
            "draft_tensor_parallel_size",
        ),
        ({"model": "a", "engine": {"model": "b"}}, "model"),
        ({"executor": "local", "tensor_parallel_size": 2}, "executor"),
    ],
)
def test_invalid_args_fail_naming_the_field(args, field):
    with pytest.raises(ValidationError) as e:
        ServeArgs.model_validate(args)
    assert field in str(e.value)


def test_shortcuts_merge_into_engine():
    args = ServeArgs.model_validate(
        {
            "model": "m",
            "tensor_parallel_size": 2,
            "speculative_config": {"method": "ngram"},
            "engine": {"seed": 3},
        }
    )
    assert (args.engine.model, args.engine.tensor_parallel_size, args.engine.seed) == ("m", 2, 3)
    assert args.engine.speculative_config.method == "ngram"
    assert not args.use_local_executor and args.model_name == "m"


def test_bad_config_file_fails_at_load(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "applications:\n  - name: x\n    import_path: cluster.app:build_app\n"
        "    args:\n      engine:\n        max_num_seqs: 0\n"
    )
    with pytest.raises(ValueError, match=r"applications\.0\.args.*engine\.max_num_seqs"):
        load_serve_config(bad)

    from flexspec.cli import app

    result = CliRunner().invoke(app, ["serve", "--config", str(bad)])
    assert result.exit_code == 2
    assert "max_num_seqs" in result.output


def test_speculative_config_option_replaces_the_files(tmp_path):
    """``flexspec serve --speculative-config JSON`` replaces the file's speculative config (top level and under
    ``engine``) in every build_app application; ``null`` serves without speculation."""
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'
    args = ServeArgs.model_validate(
        load_serve_config(CONFIGS / "serve.yaml", speculative_config=spec).applications[0].args
    )
    assert args.engine.speculative_config.method == "ngram"
    assert args.engine.speculative_config.num_speculative_tokens == 3
    assert args.engine.speculative_config.prompt_lookup_max == 2
    assert args.engine.max_model_len == 2048  # the rest of the file stays

    nested = tmp_path / "nested.yaml"  # the drafter under engine: replaced too (no clash with the top level)
    nested.write_text(
        "applications:\n  - name: x\n    import_path: cluster.app:build_app\n    args:\n      engine:\n"
        "        device: cpu\n        speculative_config: {method: ngram, num_speculative_tokens: 7}\n"
    )
    loaded = load_serve_config(nested, speculative_config='{"method": "mtp"}').applications[0].args
    assert ServeArgs.model_validate(loaded).engine.speculative_config.method == "mtp"
    plain = load_serve_config(nested, speculative_config="null").applications[0].args
    assert ServeArgs.model_validate(plain).engine.speculative_config is None
    assert _args(nested).engine.speculative_config.num_speculative_tokens == 7  # no option: the file's


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("{method: ngram", "--speculative-config is not valid JSON"),
        ("[1, 2]", "--speculative-config: expected a JSON object or null, got list"),
        (
            '{"method": "ngram", "num_speculative_tokens": 0}',
            "--speculative-config.num_speculative_tokens",
        ),
        ('{"method": "medusa"}', "--speculative-config: unknown method 'medusa' (one of: dflash, "),
        (  # valid alone, not with the file's engine: still the option's fault, not the file's
            '{"method": "ngram", "draft_tensor_parallel_size": 3}',
            "--speculative-config: draft_tensor_parallel_size must be 1 or the target's tensor_parallel_size (1)",
        ),
    ],
)
def test_invalid_speculative_config_option_fails_at_load(spec, message):
    from cluster.launcher import ServeConfigError

    with pytest.raises(ServeConfigError) as e:
        load_serve_config(CONFIGS / "serve.yaml", speculative_config=spec)
    assert str(e.value).startswith(message)
