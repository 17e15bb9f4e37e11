"""``flexspec train-drafter``: the typer front of :func:`flexspec.train.pipeline.run` (registered in
flexspec/cli.py).

Options left out keep :class:`TrainConfig`'s defaults — or, on a resumed run folder, its stored values.
List options take repeated flags or commas: ``--prompts gsm8k_train,self_instruct``.
"""

from __future__ import annotations

import sys

import typer

from flexspec.train.config import TrainConfig

_F = TrainConfig.model_fields


def _h(name: str) -> str:
    return _F[name].description or ""


def train_drafter(
    method: str = typer.Option(..., help=_h("method") + " flexdraft | dflash | dspark | eagle3"),
    output: str = typer.Option(..., help=_h("output")),
    target: str | None = typer.Option(None, help=_h("target") + " [default: smollm2-135m-instruct]"),
    prompts: list[str] | None = typer.Option(
        None,
        help=_h("prompts") + " [default: gsm8k_train,self_instruct]",  # noqa: B008
    ),
    block_size: int | None = typer.Option(None, help=_h("block_size") + " [default: 16]"),
    num_prompts: int | None = typer.Option(None, help=_h("num_prompts")),
    self_prompts: int | None = typer.Option(None, help=_h("self_prompts")),
    max_new_tokens: int | None = typer.Option(None, help=_h("max_new_tokens") + " [default: 512]"),
    max_prompt_tokens: int | None = typer.Option(None, help=_h("max_prompt_tokens")),
    temperature: float | None = typer.Option(None, help=_h("temperature") + " [default: 0]"),
    top_p: float | None = typer.Option(None, help=_h("top_p")),
    top_k: int | None = typer.Option(None, help=_h("top_k")),
    gen_batch_size: int | None = typer.Option(None, help=_h("gen_batch_size")),
    shard_size: int | None = typer.Option(None, help=_h("shard_size")),
    cache_features: bool | None = typer.Option(
        None, "--cache-features/--online-features", help=_h("cache_features")
    ),
    num_draft_layers: int | None = typer.Option(None, help=_h("num_draft_layers")),
    num_target_features: int | None = typer.Option(None, help=_h("num_target_features")),
    mask_token_id: int | None = typer.Option(None, help=_h("mask_token_id")),
    split_layer: int | None = typer.Option(None, help=_h("split_layer")),
    calibration_hidden_size: int | None = typer.Option(None, help=_h("calibration_hidden_size")),
    markov_rank: int | None = typer.Option(None, help=_h("markov_rank")),
    ttt_steps: int | None = typer.Option(None, help=_h("ttt_steps")),
    init_from: str | None = typer.Option(None, help=_h("init_from")),
    steps: int | None = typer.Option(None, help=_h("steps") + " [default: 2000]"),
    batch_size: int | None = typer.Option(None, help=_h("batch_size") + " [default: 16]"),
    lr: float | None = typer.Option(None, help=_h("lr") + " [default: 6e-4]"),
    weight_decay: float | None = typer.Option(None, help=_h("weight_decay")),
    warmup_ratio: float | None = typer.Option(None, help=_h("warmup_ratio")),
    min_lr_ratio: float | None = typer.Option(None, help=_h("min_lr_ratio")),
    grad_clip: float | None = typer.Option(None, help=_h("grad_clip")),
    num_anchors: int | None = typer.Option(None, help=_h("num_anchors")),
    gamma: float | None = typer.Option(None, help=_h("gamma")),
    max_seq_len: int | None = typer.Option(None, help=_h("max_seq_len")),
    save_every: int | None = typer.Option(None, help=_h("save_every")),
    log_every: int | None = typer.Option(None, help=_h("log_every")),
    keep_checkpoints: int | None = typer.Option(None, help=_h("keep_checkpoints")),
    seed: int | None = typer.Option(None, help=_h("seed")),
    val_datasets: list[str] | None = typer.Option(
        None,
        help=_h("val_datasets") + " [default: gsm8k:100,mt_bench:40]",  # noqa: B008
    ),
    val_max_new_tokens: int | None = typer.Option(None, help=_h("val_max_new_tokens")),
    exact_prompts: int | None = typer.Option(None, help=_h("exact_prompts")),
    val_execution: str | None = typer.Option(None, help=_h("val_execution") + " [default: decoupled]"),
    stage: str | None = typer.Option(
        None, help=_h("stage") + " all | generate | extract | train | validate | package"
    ),
    device: str | None = typer.Option(None, help=_h("device")),
    max_minutes: float | None = typer.Option(None, help=_h("max_minutes")),
) -> None:
    """Train a drafter: generate -> extract -> train -> validate -> package (each stage resumes)."""
    from pydantic import ValidationError

    from flexspec.errors import FlexspecError
    from flexspec.train.config import TrainInputError

    given = {k: v for k, v in locals().items() if k in _F and v is not None}
    try:
        cfg = TrainConfig(**given)
    except ValidationError as e:
        parts = [
            f"--{'.'.join(str(x) for x in err['loc']).replace('_', '-')}: {err['msg']}" for err in e.errors()
        ]
        typer.secho("error: " + "; ".join(parts), fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    from flexspec.train.pipeline import run

    try:
        code = run(cfg, ["flexspec", *sys.argv[1:]])
    except TrainInputError as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    except FlexspecError as e:  # --device cuda without a GPU, an unknown --target, ...
        typer.secho(f"error: {e.message}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(code)
