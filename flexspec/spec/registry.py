"""Method name -> drafter class. Each method lives in its own module and registers itself here."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from flexspec.spec.base import Drafter

if TYPE_CHECKING:
    from flexspec.engine.model_runner import ModelRunner

_MODULES = {
    "ngram": "flexspec.spec.ngram",
    "draft_model": "flexspec.spec.draft_model",
    "dflash": "flexspec.spec.dflash",
    "dspark": "flexspec.spec.dspark",
    "eagle3": "flexspec.spec.eagle3",
    "mtp": "flexspec.spec.mtp",
    "flexdraft": "flexspec.spec.flexdraft",
}
DRAFTERS: dict[str, type[Drafter]] = {}


def register(cls: type[Drafter]) -> type[Drafter]:
    DRAFTERS[cls.method] = cls
    return cls


def build_drafter(config, runner: ModelRunner) -> Drafter:
    """Instantiate the drafter for ``config.method`` next to ``runner``'s target shard."""
    if config.method not in DRAFTERS:
        if config.method not in _MODULES:
            raise ValueError(f"unknown speculative method {config.method!r}; known: {sorted(_MODULES)}")
        importlib.import_module(_MODULES[config.method])
    return DRAFTERS[config.method](config, runner)
