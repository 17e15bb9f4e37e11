"""Find and load weights: HF checkpoint folders (safetensors) and GGUF files; never pickle.

GGUF files are dequantized once by transformers' GGUF reader and cached as an HF folder with safetensors
(``$FLEXSPEC_CACHE_DIR`` or ``~/.cache/flexspec``), so later loads take seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from flexspec.errors import ModelLoadError, ModelNotFoundError
from flexspec.models.registry import BUILTIN_DRAFTERS, BUILTIN_MODELS, folder_without_config

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def cache_dir() -> Path:
    path = Path(os.environ.get("FLEXSPEC_CACHE_DIR", Path.home() / ".cache" / "flexspec"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def resolve_model_dir(model: str) -> Path:
    """Map a model id / folder / .gguf path to an HF folder with config.json + *.safetensors.

    Raises:
        ModelNotFoundError: unknown id or missing path.
        ModelLoadError: the folder holds only pickle checkpoints, or GGUF conversion failed.
    """
    if model in BUILTIN_MODELS:
        return _gguf_to_folder(BUILTIN_MODELS[model](), name=model)
    if model in BUILTIN_DRAFTERS:
        return BUILTIN_DRAFTERS[model]()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_to_folder(path, name=path.stem)
    if path.is_file() and path.suffix in PICKLE_SUFFIXES:
        raise ModelLoadError(
            f"refusing pickle checkpoint {path}: only safetensors or GGUF weights are loaded"
        )
    if path.is_dir():
        problem = folder_without_config(model)
        if problem is not None:
            raise ModelLoadError(problem)
        if not list(path.glob("*.safetensors")):
            pickles = [p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES]
            if pickles:
                raise ModelLoadError(
                    f"{path} holds only pickle checkpoints ({', '.join(pickles)}); "
                    "convert them to safetensors — pickle files are never loaded"
                )
            raise ModelLoadError(f"{path} has no *.safetensors weights")
        return path
    if path.is_file():
        raise ModelNotFoundError(
            f"unknown model {model!r}: a file, but not a .gguf; pass the folder that holds config.json and "
            "*.safetensors"
        )
    if "/" in model or path.suffix in (".gguf", ".safetensors"):
        raise ModelNotFoundError(f"unknown model {model!r}: no such file or folder")
    raise ModelNotFoundError(
        f"unknown model {model!r}: not a built-in model ({', '.join(BUILTIN_MODELS)}) or drafter "
        f"({', '.join(BUILTIN_DRAFTERS)}), folder or .gguf file"
    )


def _gguf_to_folder(gguf: Path, name: str) -> Path:
    """The dequantized safetensors folder of ``gguf`` in the cache, converted on first use. Keyed by the file's
    content (sha256: ~0.15 s for the default model's 98 MB), so every install of the same file (each clone's
    virtual environment) shares one copy; it was keyed by path and mtime, and each fresh clone added ~0.5 GB."""
    with open(gguf, "rb") as f:
        key = hashlib.file_digest(f, "sha256").hexdigest()[:12]
    out = cache_dir() / "models" / f"{name}-{key}"
    if (out / "config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as e:
        raise ModelLoadError(f"could not read GGUF file {gguf}: {e}") from e
    # A GGUF-loaded model is already dense; drop the quantizer so save_pretrained writes plain tensors.
    hf.hf_quantizer = None
    hf.config.quantization_config = None
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        hf.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if hf.generation_config is not None:
            hf.generation_config.save_pretrained(tmp)
        (tmp / "flexspec_source.json").write_text(json.dumps({"gguf": str(gguf)}))
        if not out.exists():  # another process may have finished first; keep its copy
            os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_config(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"invalid config.json in {folder}: {e}") from e


def load_weights(model: nn.Module, folder: Path, strip_prefixes: tuple[str, ...] = ()) -> None:
    """Copy every tensor of ``folder/*.safetensors`` into ``model`` through the parameters' weight loaders.

    Checkpoint names are HF's (``model.layers.0.self_attn.q_proj.weight``); fused parameters are
    resolved through ``model.packed_modules_mapping``.

    Raises:
        ModelLoadError: corrupt file, unknown tensor name, shape mismatch, or parameters left unloaded.
    """
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules_mapping", {})
    prefixes = strip_prefixes + ("model.language_model.", "language_model.model.", "model.")
    tied = getattr(getattr(model, "spec", None), "tie_word_embeddings", False)
    num_layers = getattr(getattr(model, "spec", None), "num_layers", None)
    loaded: set[str] = set()
    files = sorted(folder.glob("*.safetensors"))
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for ckpt_name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    name = ckpt_name
                    for p in prefixes:
                        if name.startswith(p):
                            name = name[len(p) :]
                            break
                    if tied and name == "lm_head.weight":
                        continue
                    if "rotary_emb.inv_freq" in name or name.startswith(("vision_tower.", "multi_modal")):
                        continue
                    if _is_mtp_tensor(name, num_layers):  # the model's own MTP modules: flexspec.spec.mtp
                        continue
                    shard_id = None
                    for frag, (fused, sid) in packed.items():
                        if f".{frag}." in name:
                            name, shard_id = name.replace(f".{frag}.", f".{fused}."), sid
                            break
                    param = params.get(name)
                    if param is None:
                        raise ModelLoadError(
                            f"{file.name}: checkpoint tensor {ckpt_name!r} has no matching parameter"
                        )
                    tensor = f.get_tensor(ckpt_name).to(param.dtype)
                    loader = getattr(param, "weight_loader", None)
                    try:
                        if loader is None:
                            if param.shape != tensor.shape:
                                raise ValueError(
                                    f"shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                                )
                            param.data.copy_(tensor)
                        else:
                            loader(param, tensor, shard_id)
                    except ValueError as e:
                        raise ModelLoadError(f"{file.name}: {ckpt_name}: {e}") from e
                    loaded.add(name if shard_id is None else f"{name}#{shard_id}")
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(f"corrupt or unreadable weight file {file}: {e}") from e
    loaded_params = {n.split("#")[0] for n in loaded}
    missing = [n for n in params if n not in loaded_params and not (tied and n == "lm_head.weight")]
    if missing:
        raise ModelLoadError(f"{folder}: checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")


def _is_mtp_tensor(name: str, num_layers: int | None) -> bool:
    """Multi-token-prediction weights (Qwen3-Next/3.5 ``mtp.*``; DeepSeek-V3 ``layers.{i >= num_layers}``)."""
    if name.startswith("mtp."):
        return True
    if num_layers is None or not name.startswith("layers."):
        return False
    idx = name.split(".", 2)[1]
    return idx.isdigit() and int(idx) >= num_layers
