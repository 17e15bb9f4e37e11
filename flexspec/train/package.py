"""Stage (e): ``DIR/final/`` — what the server loads by path, plus how it was made.

``config.json`` + ``model.safetensors`` (bf16, cast from the latest fp32 checkpoint), ``recipe.json`` (config,
every command run on the folder, data recipe, training summary, validation) and ``README.md``. Use it as
``speculative_config = {"method": <method>, "model": "<DIR>/final", "num_speculative_tokens": B-1}``.
"""

from __future__ import annotations

import json
import platform
import shutil
from pathlib import Path
from typing import Any

import torch

from flexspec.spec.models.checkpoint import read_config, read_tensors, save_checkpoint
from flexspec.train.checkpoint import checkpoint_step, latest_checkpoint
from flexspec.train.config import TrainConfig, TrainInputError
from flexspec.train.data import read_jsonl, write_json
from flexspec.train.methods.base import TrainMethod
from flexspec.train.progress import Deadline, log


def final_dir(root: Path) -> Path:
    return root / "final"


def export_weights(cfg: TrainConfig) -> tuple[Path, int]:
    """Cast the latest checkpoint's drafter to bf16 into ``final/`` (skipped when already current).

    Returns (folder, training step). Raises ValueError if there is no checkpoint yet.
    """
    root = cfg.dir
    ckpt = latest_checkpoint(root)
    if ckpt is None:
        raise TrainInputError(f"no checkpoint in {root / 'checkpoints'}: run --stage train first")
    step = checkpoint_step(ckpt)
    out = final_dir(root)
    recipe_path = out / "recipe.json"
    if recipe_path.is_file() and json.loads(recipe_path.read_text()).get("step") == step:
        return out, step
    src = ckpt / "drafter"
    tensors = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in read_tensors(src).items()}
    tmp = out.with_name("final.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_checkpoint(tmp, read_config(src), tensors)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    write_json(out / "recipe.json", {"method": cfg.method, "step": step})
    log.info("package: %s (step %d) -> %s in bf16", ckpt.name, step, out)
    return out, step


def run_package(cfg: TrainConfig, method: TrainMethod, deadline: Deadline) -> bool:
    root = cfg.dir
    out, step = export_weights(cfg)
    recipe = build_recipe(cfg, method, step)
    write_json(out / "recipe.json", recipe)
    (out / "README.md").write_text(readme(cfg, recipe))
    for name in ("validation.json", "loss_curve.png", "train_log.jsonl"):
        if (root / name).is_file():
            shutil.copy(root / name, out / name)
    log.info(
        "package: %s ready (load with speculative_config %s)",
        out,
        json.dumps(method.speculative_config(str(out))),
    )
    return True


def build_recipe(cfg: TrainConfig, method: TrainMethod, step: int) -> dict[str, Any]:
    root = cfg.dir
    meta_path = root / "data" / "meta.json"
    rows = list(read_jsonl(root / "train_log.jsonl"))
    val_path = root / "validation.json"
    import transformers

    return {
        "method": cfg.method,
        "step": step,
        "speculative_config": method.speculative_config("<this folder>"),
        "commands": [r["command"] for r in read_jsonl(root / "commands.jsonl")],
        "config": cfg.model_dump(mode="json"),
        "data": json.loads(meta_path.read_text()) if meta_path.is_file() else None,
        "training": {
            "steps": step,
            "final": rows[-1] if rows else None,
            "loss_first": rows[0]["loss"] if rows else None,
        },
        "validation": json.loads(val_path.read_text()) if val_path.is_file() else None,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
    }


def _portable(name: str) -> str:
    """A model id as given; a filesystem path as its last component (paths are machine-local)."""
    return Path(name).name if ("/" in name or "\\" in name) else name


def readme(cfg: TrainConfig, recipe: dict[str, Any]) -> str:
    """The package's README: how to load it, how it was made, what was measured and where.

    Only facts the run recorded and no machine-local paths (those stay in recipe.json's ``commands``):
    a target given as a path is named by its file / folder name. Exactness is stated as a property of
    verification, not of the drafter; the token-for-token check against plain decoding is reported with
    what explains a mismatch.
    """
    val = recipe.get("validation") or {}
    target = _portable(cfg.target)
    target_arg = cfg.target if target == cfg.target else f"<path to {target}>"
    spec = {**recipe["speculative_config"], "model": "<path to this folder>"}
    prompts = [_portable(p) for p in cfg.prompts]
    lines = [
        f"# {cfg.method} drafter for `{target}` (block size {cfg.block_size})",
        "",
        "Load by path:",
        "```",
        f"flexspec generate --model {target_arg} --speculative-config '{json.dumps(spec)}' \"...\"",
        "```",
        "",
        (
            f"Trained {recipe['step']} steps with `flexspec train-drafter` (flexspec/train); recipe.json holds "
            "every setting (`config`) and the commands run on the run folder (`commands`)."
        ),
        "",
        "Data: target responses generated by flexspec's engine with the target's chat template "
        f"(sampling {json.dumps((recipe.get('data') or {}).get('sampling'))}) to prompts from "
        f"{', '.join(prompts)}"
        + (f" + {cfg.self_prompts} prompts written by the target" if cfg.self_prompts else "")
        + ". No test set was used for training.",
        "",
    ]
    if val.get("datasets"):
        vspec = val.get("speculative_config") or {}
        where = " on ".join(x for x in (val.get("dtype"), val.get("device")) if x)
        lines += [
            (
                "Acceptance, measured by the run's validate stage (flexspec/train/validate.py): flexspec's "
                f"engine decoding with this drafter ({vspec.get('execution', 'auto')} execution, "
                f"{vspec.get('num_speculative_tokens')} draft tokens per step, T=0, up to "
                f"{val.get('max_new_tokens')} new tokens per prompt{', ' + where if where else ''}) on the "
                "first N prompts of each held-out set, counted by the engine's spec-decode metrics (MAL = 1 + "
                "accepted tokens / drafts); raw counts in validation.json."
            ),
            "",
            "| dataset | prompts | MAL | per-position acceptance |",
            "|---|---|---|---|",
        ]
        for name, r in val["datasets"].items():
            m = r["metrics"]
            per = ", ".join(f"{x:.2f}" for x in m["per_position_acceptance"])
            lines.append(f"| {name} | {r['num_prompts']} | {m['mean_acceptance_length']:.2f} | {per} |")
    lines += [
        "",
        (
            "Exactness is a property of verification, not of the drafter: a draft token is accepted only where "
            "plain decoding would have produced the same token at that position (same sample; the argmax at "
            "T=0), and drafts with a proposal distribution go through rejection sampling, so the output "
            "distribution is the target's whatever this drafter proposes; the drafter only sets how many "
            "tokens each step accepts."
        ),
    ]
    if "exact" in val:
        lines.append("")
        n = val["exact"]["num_prompts"]
        same = n - len(val["exact"].get("mismatches", []))
        lines.append(
            f"Token-for-token check against plain decoding in the validate stage: {same} of {n} prompts "
            "identical." + _mismatch_note(same, n, val.get("dtype"))
        )
    lines += ["", "Files: config.json + model.safetensors (bf16) are the drafter; recipe.json holds the full",
              "recipe; validation.json the measured counts; train_log.jsonl / loss_curve.png the training",
              "curves.", ""]  # fmt: skip
    return "\n".join(lines)


def _mismatch_note(same: int, n: int, dtype: str | None) -> str:
    if same == n:
        return ""
    if dtype == "float32":
        return (
            " In float32 speculative and plain decoding should agree token for token: this points to a bug."
        )
    return (
        " In bf16 such differences come from rounding, not from the drafter: the verification forward runs other "
        "matrix shapes than a one-token decode, which in bf16 flips near-tied argmaxes (plain decoding's own "
        "output changes with batch size the same way); in float32 the outputs are identical (tests/spec)."
    )
