"""Training methods, one module each, looked up by ``--method`` (same names as the engine's drafters)."""

from __future__ import annotations

import importlib

from flexspec.train.config import TrainConfig
from flexspec.train.methods.base import TrainMethod

_MODULES = {
    "flexdraft": ("flexspec.train.methods.flexdraft", "FlexDraftMethod"),
    "dflash": ("flexspec.train.methods.dflash", "DFlashMethod"),
    "dspark": ("flexspec.train.methods.dspark", "DSparkMethod"),
    "eagle3": ("flexspec.train.methods.eagle3", "Eagle3Method"),
}


def get_method(cfg: TrainConfig) -> TrainMethod:
    if cfg.method not in _MODULES:
        raise ValueError(f"unknown method {cfg.method!r}; known: {sorted(_MODULES)}")
    module, cls = _MODULES[cfg.method]
    return getattr(importlib.import_module(module), cls)(cfg)
