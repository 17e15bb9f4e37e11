"""Backend choice shared by every op's dispatcher."""

from __future__ import annotations

from typing import Literal

import torch

Backend = Literal["auto", "triton", "torch", "torch_ref"]


def use_triton(backend: str, tensor: torch.Tensor) -> bool:
    """``"auto"``: Triton for CUDA tensors (ROCm builds report ``is_cuda`` too), torch otherwise."""
    if backend == "auto":
        return tensor.is_cuda
    if backend not in ("triton", "torch", "torch_ref"):
        raise ValueError(f"backend must be 'auto', 'triton', 'torch' or 'torch_ref', got {backend!r}")
    return backend == "triton"


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET``; the only way to run them on CPU)."""
    import os

    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


class EnvSettingError(ValueError):
    """A ``FLEXSPEC_*`` environment variable set to a value the code cannot use; raised where it is read (at
    import), naming the variable, so front ends can report it in one line."""


_ON = ("1", "true", "on", "yes")
_OFF = ("0", "false", "off", "no")


def env_flag(name: str, default: bool, environ=None) -> bool:
    """A boolean ``FLEXSPEC_*`` switch: 1 / true / on / yes or 0 / false / off / no (any case); unset or empty =
    ``default``. Raises EnvSettingError naming the variable for any other value."""
    import os

    raw = (environ if environ is not None else os.environ).get(name, "")
    v = raw.strip().lower()
    if not v:
        return default
    if v in _ON:
        return True
    if v in _OFF:
        return False
    raise EnvSettingError(f"{name}={raw!r}: expected one of {', '.join(_ON + _OFF)}")
