"""Bad input gives a clear, typed error and the engine keeps working (issue 2)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from configs import EngineConfig, SamplingParams
from flexspec.errors import (
    ContextLengthExceededError,
    InvalidRequestError,
    ModelLoadError,
    ModelNotFoundError,
)
from flexspec.models.loader import resolve_model_dir


def test_empty_prompt(engine):
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("", SamplingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request([], SamplingParams())


def test_prompt_longer_than_max_model_len(engine):
    with pytest.raises(ContextLengthExceededError, match="max_model_len"):
        engine.add_request([1] * engine.config.max_model_len, SamplingParams())


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 10**23}, "top_k"),  # overflowed int64 in the sampler's tensor, inside the engine loop
        ({"stop": [""]}, "stop"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValidationError) as e:
        SamplingParams(**kwargs)
    assert field in str(e.value)


def test_tiny_temperature_and_top_p_sample_the_top_token(engine):
    """A temperature below 1e-5 is greedy (vLLM); a top_p that rounds to 0 in float32 keeps the top token.
    Both used to give NaN probabilities and token 0 (<|endoftext|>) at every step."""
    greedy = engine.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0))[0].token_ids
    assert (
        SamplingParams(temperature=1e-38).temperature == 0.0 and SamplingParams(temperature=1e-5).temperature
    )
    for params in (SamplingParams(temperature=1e-38), SamplingParams(top_p=1e-300, seed=1)):
        out = engine.generate(["Hello"], params.model_copy(update={"max_tokens": 4}))[0].token_ids
        assert out == greedy, params


def test_nan_is_called_not_finite():  # not "should be <= 100" (its failed range check)
    with pytest.raises(ValidationError, match="finite number"):
        SamplingParams(temperature=float("nan"))


def test_unknown_model_id():
    with pytest.raises(ModelNotFoundError, match="unknown model"):
        resolve_model_dir("no-such-model")


def test_missing_or_wrong_model_path_says_so(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such file or folder"):
        resolve_model_dir(str(tmp_path / "missing.gguf"))
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="not a .gguf; pass the folder"):
        resolve_model_dir(str(weights))


def test_folder_without_config_named_as_the_cli_names_it(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError) as err:
        resolve_model_dir(str(tmp_path))
    assert str(err.value) == (
        f"model {str(tmp_path)!r} is a folder without config.json "
        "(a checkpoint folder holds config.json and *.safetensors)"
    )


def test_pickle_checkpoint_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(ModelLoadError, match="pickle"):
        resolve_model_dir(str(tmp_path))


def test_corrupt_weight_file(engine, tmp_path):
    src = engine.executor.model_dir
    import shutil
    from pathlib import Path

    for f in Path(src).iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage}")
    from flexspec.engine.model_runner import ModelRunner

    with pytest.raises(ModelLoadError, match="corrupt"):
        ModelRunner(EngineConfig(model=str(tmp_path), device="cpu", max_model_len=256))


def test_invalid_engine_config_names_field():
    with pytest.raises(ValidationError, match="max_model_len"):
        EngineConfig(max_model_len=0)
    with pytest.raises(ValidationError, match="speculative_config"):
        EngineConfig(speculative_config={"method": "nope"})


def test_engine_still_serves_after_errors(engine):
    with pytest.raises(InvalidRequestError):
        engine.add_request("", SamplingParams())
    out = engine.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0))[0]
    assert len(out.token_ids) == 3


def test_gguf_cache_is_keyed_by_content(tmp_path, monkeypatch):
    """Two installs of the same GGUF file (two clones' virtual environments) share one dequantized copy, found
    without reading the GGUF again; a file with other content has its own key (converted afresh)."""
    import hashlib

    from flexspec.models import loader

    monkeypatch.setenv("FLEXSPEC_CACHE_DIR", str(tmp_path / "cache"))
    a, b, c = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf", tmp_path / "c" / "m.gguf"
    for path, data in ((a, b"GGUF same bytes"), (b, b"GGUF same bytes"), (c, b"GGUF other bytes")):
        path.parent.mkdir()
        path.write_bytes(data)
    with pytest.raises(ModelLoadError):  # not a real GGUF: converting it fails and caches nothing
        loader._gguf_to_folder(a, name="m")
    cached = tmp_path / "cache" / "models" / f"m-{hashlib.sha256(b'GGUF same bytes').hexdigest()[:12]}"
    assert not cached.exists()
    cached.mkdir(parents=True)  # as a finished conversion leaves it
    (cached / "config.json").write_text("{}")
    assert loader._gguf_to_folder(a, name="m") == cached
    assert loader._gguf_to_folder(b, name="m") == cached
    with pytest.raises(ModelLoadError):
        loader._gguf_to_folder(c, name="m")
