"""Drafter checkpoints: an HF-style folder with ``config.json`` + ``*.safetensors`` (pickle is never read).

Every failure is a ``ModelLoadError`` that names the folder and the field or tensor at fault, so a user can
tell a wrong checkpoint (missing tensor, wrong shape, bad config field) from a bug.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from flexspec.errors import ModelLoadError

_MISSING = object()


def read_config(folder: Path) -> dict[str, Any]:
    """``folder/config.json`` as a dict."""
    path = Path(folder) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{folder}: no config.json") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: invalid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return cfg


def config_field(
    cfg: dict[str, Any], path: str, kind: type | tuple[type, ...], source: str, default: Any = _MISSING
) -> Any:
    """Value at dotted ``path`` (e.g. ``"dflash_config.mask_token_id"``), type-checked.

    Raises:
        ModelLoadError: the field is missing (and has no default) or has the wrong type.
    """
    node: Any = cfg
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node or node[part] is None:
            if default is _MISSING:
                raise ModelLoadError(f"{source}: config.json lacks field {path!r}")
            return default
        node = node[part]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    ok = isinstance(node, kinds) and not (isinstance(node, bool) and bool not in kinds)
    if float in kinds and isinstance(node, int) and not isinstance(node, bool):
        node, ok = float(node), True
    if not ok:
        names = "/".join(k.__name__ for k in kinds)
        raise ModelLoadError(f"{source}: config.json field {path!r} must be {names}, got {node!r}")
    return node


def tensor_names(folder: Path) -> list[str]:
    """Names of all tensors in ``folder/*.safetensors`` (reads headers only)."""
    names: list[str] = []
    for file in _weight_files(folder):
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                names.extend(f.keys())
        except Exception as e:
            raise ModelLoadError(f"corrupt or unreadable weight file {file}: {e}") from e
    return names


def read_tensors(folder: Path, keep: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """Tensors of ``folder/*.safetensors`` (only names where ``keep(name)``), on CPU in their stored dtype."""
    out: dict[str, torch.Tensor] = {}
    for file in _weight_files(folder):
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                    if keep is None or keep(name):
                        out[name] = f.get_tensor(name)
        except Exception as e:
            raise ModelLoadError(f"corrupt or unreadable weight file {file}: {e}") from e
    return out


def load_state(
    module: nn.Module, tensors: dict[str, torch.Tensor], source: str, ignore: frozenset[str] = frozenset()
) -> None:
    """Copy ``tensors`` into ``module.state_dict()`` names exactly: every parameter / persistent buffer must
    be present with its shape, and no tensor may be left over (names in ``ignore`` are allowed and skipped).

    Raises:
        ModelLoadError: naming the missing, unexpected or mis-shaped tensor.
    """
    expected = module.state_dict()
    missing = [n for n in expected if n not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"{source}: checkpoint is missing tensor {missing[0]!r}{more}")
    unexpected = sorted(n for n in tensors if n not in expected and n not in ignore)
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ModelLoadError(f"{source}: unexpected tensor {unexpected[0]!r}{more} in checkpoint")
    with torch.no_grad():
        for name, dst in expected.items():
            src = tensors[name]
            if tuple(src.shape) != tuple(dst.shape):
                raise ModelLoadError(
                    f"{source}: tensor {name!r} has shape {list(src.shape)}, expected {list(dst.shape)}"
                )
            dst.copy_(src.to(dst.dtype))


def save_checkpoint(folder: Path, config: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
    """Write ``config.json`` and ``model.safetensors`` (contiguous CPU copies of ``state``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tensors = {n: t.detach().to("cpu").contiguous().clone() for n, t in state.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _weight_files(folder: Path) -> list[Path]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights (pickle checkpoints are never loaded)")
    return files
