"""``python -m flexspec.train.run_device``: the pipeline without typer/rich (GPU machines with a bare Python).

Flags are generated from :class:`TrainConfig` (``--block-size 16``, ``--prompts gsm8k_train self_instruct``,
``--cache-features/--no-cache-features``, ...), so they always match ``flexspec train-drafter``. Two helper
commands move a run folder through size-capped transfers (see :mod:`flexspec.train.transfer`)::

    python -m flexspec.train.run_device --method flexdraft --output /tmp/run --max-minutes 8.5 ...
    python -m flexspec.train.run_device export --output /tmp/run --to $OUT      # results + resumable state
    python -m flexspec.train.run_device import --output /tmp/run --from DIR     # restore an exported state
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from typing import Any, Literal

from pydantic import ValidationError

from flexspec.train.config import TrainConfig, TrainInputError


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """(inner type, optional) for ``X | None``."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return inner[0], True
    return annotation, False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flexspec.train.run_device", description="Train a drafter (flexspec train-drafter)."
    )
    for name, field in TrainConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        kind, optional = _unwrap(field.annotation)
        kw: dict[str, Any] = {"help": field.description, "dest": name, "default": argparse.SUPPRESS}
        if field.is_required():
            kw["required"] = True
        origin = typing.get_origin(kind)
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif origin is Literal:
            kw["choices"] = list(typing.get_args(kind))
        elif origin is list:
            kw["nargs"] = "+"
        else:
            base = kind
            kw["type"] = (lambda s, base=base: None if s.lower() == "none" else base(s)) if optional else base
        parser.add_argument(flag, **kw)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("export", "import"):
        from flexspec.train.transfer import main as transfer_main

        return transfer_main(argv)
    args = vars(build_parser().parse_args(argv))
    try:
        cfg = TrainConfig(**args)
    except ValidationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from flexspec.train.pipeline import run

    try:
        return run(cfg, [sys.executable, "-m", "flexspec.train.run_device", *argv])
    except TrainInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
