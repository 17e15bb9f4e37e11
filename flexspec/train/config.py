"""``TrainConfig``: every setting of one drafter-training run (one output folder).

The first run writes it to ``DIR/config.json``; later runs on the same folder resume with the stored values.
Flags left out on a later run keep the stored values. Fields in :data:`RUN_CONTROL_FIELDS` may be changed
(how far / how long to go, where to run); so may ``target`` (with a warning: the same weights sit at different
paths on different machines). Giving any other field a value that differs from the stored one is an error,
because the data or checkpoints in the folder were made with the stored value.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from flexspec.train.progress import log

Method = Literal["flexdraft", "dflash", "dspark", "eagle3"]
Stage = Literal["all", "generate", "extract", "train", "validate", "package"]
STAGES: tuple[str, ...] = ("generate", "extract", "train", "validate", "package")

# Fields that apply to one invocation only (never inherited from the stored config).
PER_INVOCATION_FIELDS = frozenset({"stage", "max_minutes", "output"})
# Fields that may be changed explicitly on a resumed run.
RUN_CONTROL_FIELDS = frozenset(
    {
        "stage", "max_minutes", "device", "steps", "num_prompts", "self_prompts", "save_every", "log_every",
        "keep_checkpoints", "gen_batch_size", "val_datasets", "val_max_new_tokens", "exact_prompts",
        "cache_features", "output", "val_execution",
    }
)  # fmt: skip


class TrainInputError(ValueError):
    """Something the user can fix: bad prompts, a missing earlier stage, a run folder made differently."""


class ConfigMismatchError(TrainInputError):
    """A resumed run asked for a setting that contradicts the folder's stored config."""


class TrainConfig(BaseModel):
    """Settings of ``flexspec train-drafter`` (CLI flags are the field names with dashes)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    # ---- what ----------------------------------------------------------------------------------------------
    method: Method = Field(..., description="Drafting method to train.")
    target: str = Field("smollm2-135m-instruct", description="Target model id, HF folder or .gguf file.")
    output: str = Field(..., description="Run folder: data, checkpoints, logs and final/ live here.")
    block_size: int = Field(16, ge=2, le=64, description="Draft block size B (B-1 drafts per step).")

    # ---- (a) generate --------------------------------------------------------------------------------------
    prompts: list[str] = Field(
        default_factory=lambda: ["gsm8k_train", "self_instruct"],
        description="Training prompt sources: dataset names (gsm8k_train, self_instruct) or .jsonl/.txt "
        "files. Test sets (gsm8k, math500, humaneval, mt_bench) are refused.",
    )
    num_prompts: int | None = Field(
        None, gt=0, description="Use at most this many prompts (shuffled); None = all."
    )
    self_prompts: int = Field(0, ge=0, description="Also ask the target to write this many new prompts.")
    max_new_tokens: int = Field(512, gt=0, description="Response length cap when generating training data.")
    max_prompt_tokens: int = Field(512, gt=0, description="Prompts longer than this (tokens) are skipped.")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature of the target's responses.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass of the target's responses.")
    top_k: int = Field(-1, ge=-1, description="Top-k of the target's responses (-1 = off).")
    gen_batch_size: int = Field(128, gt=0, description="Prompts per engine batch while generating.")
    shard_size: int = Field(1024, gt=0, description="Responses per data shard (jsonl).")

    # ---- (b) extract ---------------------------------------------------------------------------------------
    cache_features: bool = Field(
        False, description="Cache target hidden states as safetensors shards (default: computed online)."
    )

    # ---- drafter shape -------------------------------------------------------------------------------------
    num_draft_layers: int = Field(3, ge=1, description="dflash/dspark: drafter decoder layers.")
    num_target_features: int | None = Field(
        None,
        ge=1,
        description="dflash/dspark: target layers read (default: one per drafter layer, z-lab rule).",
    )
    mask_token_id: int | None = Field(
        None, ge=0, description="dflash/dspark: MASK token id (default: last id)."
    )
    split_layer: int | None = Field(
        None,
        ge=1,
        description="flexdraft: first tuned layer (default: L - max(2, L // 6)).",
    )
    calibration_hidden_size: int = Field(1024, gt=0, description="flexdraft: calibration MLP width.")
    markov_rank: int = Field(256, gt=0, description="dspark: rank of the Markov head.")
    ttt_steps: int = Field(7, ge=1, le=32, description="eagle3: training-time-test unroll depth.")

    # ---- (c) train -----------------------------------------------------------------------------------------
    init_from: str | None = Field(
        None,
        description="Start from this drafter's weights instead of a fresh initialisation (built-in drafter id "
        "or packaged folder; same method and shape; fresh optimizer and schedule), e.g. to continue the shipped "
        "drafter on more data.",
    )
    steps: int = Field(2000, gt=0, description="Optimizer steps in total (a resumed run continues to this).")
    batch_size: int = Field(16, gt=0, description="Sequences per step.")
    lr: float = Field(6e-4, gt=0.0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    warmup_ratio: float = Field(0.04, ge=0.0, lt=1.0, description="Linear warm-up share of ``steps``.")
    min_lr_ratio: float = Field(0.05, ge=0.0, le=1.0, description="Cosine floor as a share of ``lr``.")
    grad_clip: float = Field(1.0, gt=0.0, description="Gradient-norm clip.")
    num_anchors: int = Field(32, gt=0, description="dflash/dspark/flexdraft: random blocks per sequence.")
    gamma: float | None = Field(
        None,
        gt=0.0,
        description="Position-decay of the CE weight exp(-(k-1)/gamma); default 7 for B>=16, "
        "5 for B>=10, else 4 (DFlash).",
    )
    max_seq_len: int = Field(1024, gt=8, description="Training sequences are cut to this many tokens.")
    save_every: int = Field(200, gt=0, description="Checkpoint every N steps (and at the end / time limit).")
    log_every: int = Field(10, gt=0, description="Append to train_log.jsonl every N steps.")
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept on disk (oldest deleted).")
    seed: int = Field(0, description="Seed of prompt order, data order, anchors and initialisation.")

    # ---- (d) validate --------------------------------------------------------------------------------------
    val_datasets: list[str] = Field(
        default_factory=lambda: ["gsm8k:100", "mt_bench:40"],
        description="Held-out sets as NAME[:N] (first N prompts): gsm8k, math500, humaneval, mt_bench.",
    )
    val_max_new_tokens: int = Field(256, gt=0, description="Output tokens per validation prompt.")
    exact_prompts: int = Field(4, ge=0, description="Prompts checked token-for-token against plain decoding.")
    val_execution: Literal["auto", "parallel", "decoupled"] = Field(
        "decoupled",
        description="Engine execution mode while validating (auto may fall back to plain decoding, which "
        "thins the acceptance sample; parallel is flexdraft only).",
    )

    # ---- run control ---------------------------------------------------------------------------------------
    stage: Stage = Field("all", description="Run one stage, or all in order (each resumes where it stopped).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available.")
    max_minutes: float | None = Field(
        None, gt=0.0, description="Stop cleanly (checkpoint, exit code 75) after this many minutes."
    )

    @field_validator("prompts", "val_datasets", mode="before")
    @classmethod
    def _split_commas(cls, v: object) -> object:
        """``["a,b", "c"]`` or ``"a,b"`` -> ``["a", "b", "c"]`` (flags may be repeated or comma-separated)."""
        items = [v] if isinstance(v, str) else v
        if isinstance(items, list) and all(isinstance(x, str) for x in items):
            return [part.strip() for x in items for part in x.split(",") if part.strip()]
        return v

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.split_layer is not None and self.method != "flexdraft":
            raise ValueError("split_layer applies to method flexdraft only")
        return self

    @property
    def decay_gamma(self) -> float:
        if self.gamma is not None:
            return self.gamma
        return 7.0 if self.block_size >= 16 else 5.0 if self.block_size >= 10 else 4.0

    @property
    def warmup_steps(self) -> int:
        return int(self.steps * self.warmup_ratio)

    @property
    def dir(self) -> Path:
        return Path(self.output)


def resolve_config(cfg: TrainConfig) -> TrainConfig:
    """Merge ``cfg`` with ``DIR/config.json`` when it exists, then store the result.

    Fields the caller did not set (``cfg.model_fields_set``) keep their stored values, except the
    per-invocation ``stage`` and ``max_minutes``. Fields set explicitly: run-control fields take the new
    value, ``target`` too (with a warning), any other must equal the stored value.

    Raises:
        ConfigMismatchError: a non-run-control field was set to a value other than the stored one.
    """
    path = cfg.dir / "config.json"
    if not path.is_file():
        cfg.dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cfg.model_dump(mode="json"), indent=2) + "\n")
        return cfg
    try:
        stored = TrainConfig(**json.loads(path.read_text()))
    except (ValidationError, json.JSONDecodeError) as e:
        raise ConfigMismatchError(f"{path} is not a valid TrainConfig: {e}") from e
    merged = stored.model_dump()
    for name, value in cfg.model_dump().items():
        if name in PER_INVOCATION_FIELDS:
            merged[name] = value
        elif name not in cfg.model_fields_set or value == merged[name]:
            continue
        elif name == "target":
            # Paths differ between machines (a .gguf here, a converted folder there): allowed, but said.
            log.warning("target %r differs from the stored %r: data and checkpoints were made with the "
                        "stored one; continuing with %r", value, merged[name], value)  # fmt: skip
            merged[name] = value
        elif name in RUN_CONTROL_FIELDS:
            merged[name] = value
        else:
            raise ConfigMismatchError(
                f"--{name.replace('_', '-')} {value!r} contradicts {path} ({merged[name]!r}); use a new "
                "--output folder, or drop the flag to continue the stored run"
            )
    out = TrainConfig(**merged)
    path.write_text(json.dumps(out.model_dump(mode="json"), indent=2) + "\n")
    return out
