"""Stage (d): acceptance of the trained drafter with the REAL speculative decoder (LLMEngine, T=0).

For each held-out set (``val_datasets``: NAME[:N], the first N prompts; test sets are fine here, they are
never trained on) the engine decodes with ``speculative_config = {"method", "model": DIR/final, ...}`` and its
counters give MAL and per-position acceptance (DESIGN.md section 4 definitions). The first ``exact_prompts``
prompts are also decoded without speculation and compared token for token: identical in float32; in bf16 the
verification forward's other GEMM shapes can flip near-tied argmaxes, so a mismatch there is rounding, not a
wrong acceptance (verification is exact whatever the drafter). Results, with the device and dtype they were
measured in, go to ``DIR/validation.json``, one dataset at a time (a resumed run skips finished datasets of the
same checkpoint).
"""

from __future__ import annotations

import json
import time
from typing import Any

from flexspec.datasets import load_prompts
from flexspec.spec.metrics import SpecDecodingMetrics
from flexspec.train.config import TrainConfig, TrainInputError
from flexspec.train.data import write_json
from flexspec.train.methods.base import TrainMethod
from flexspec.train.package import export_weights
from flexspec.train.progress import Deadline, log
from flexspec.train.prompts import TEST_DATASETS


def parse_val_sets(specs: list[str]) -> list[tuple[str, str, int | None]]:
    """``["gsm8k:100", "mt_bench"]`` -> [(key, dataset, first N or None)]; results are keyed by ``key``."""
    out = []
    for s in specs:
        name, _, n = s.partition(":")
        if name not in TEST_DATASETS or (n and not n.isdigit()):
            raise TrainInputError(
                f"--val-datasets entry {s!r}: expected NAME[:N] with NAME in {', '.join(TEST_DATASETS)}"
            )
        out.append((s, name, int(n) if n else None))
    return out


def _engine(cfg: TrainConfig, speculative_config: dict | None, max_model_len: int):
    from configs import EngineConfig
    from flexspec.engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model=cfg.target,
            device=cfg.device,
            max_model_len=max_model_len,
            max_num_seqs=64,
            seed=cfg.seed,
            speculative_config=speculative_config,
        )
    )


def run_validate(cfg: TrainConfig, method: TrainMethod, deadline: Deadline) -> bool:
    from configs import SamplingParams
    from flexspec.engine.model_runner import resolve_device, resolve_dtype
    from flexspec.train.features import target_spec

    root = cfg.dir
    folder, step = export_weights(cfg)
    path = root / "validation.json"
    spec_config = {**method.speculative_config(str(folder)), "execution": cfg.val_execution}
    setup = {"step": step, "speculative_config": spec_config, "max_new_tokens": cfg.val_max_new_tokens}
    results: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    if any(results.get(k) != v for k, v in setup.items()):  # another checkpoint or setup: start over
        results = {**setup, "temperature": 0.0, "datasets": {}}
    todo = [key for key, _, _ in parse_val_sets(cfg.val_datasets) if key not in results["datasets"]]
    if not todo and ("exact" in results or cfg.exact_prompts == 0):
        log.info("validate: step %d already validated", step)
        return True
    max_model_len = min(target_spec(cfg).max_position_embeddings, 2048 + cfg.val_max_new_tokens)
    engine = _engine(cfg, spec_config, max_model_len)
    device = resolve_device(engine.config)
    results.setdefault("device", device.type)
    results.setdefault("dtype", str(resolve_dtype(engine.config, device)).removeprefix("torch."))
    params = SamplingParams(max_tokens=cfg.val_max_new_tokens, temperature=0.0)
    exact_outputs: list[tuple[list[int], list[int]]] = []
    for key, name, limit in parse_val_sets(cfg.val_datasets):
        need_exact = not exact_outputs and "exact" not in results and cfg.exact_prompts > 0
        if key in results["datasets"] and not need_exact:
            continue
        if deadline.expired():
            write_json(path, results)
            return False
        prompts = _prompt_ids(engine, name, limit, max_model_len - cfg.val_max_new_tokens)
        if key in results["datasets"]:  # only the exactness prompts are still needed
            prompts = prompts[: cfg.exact_prompts]
        engine.spec_metrics = SpecDecodingMetrics()
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        elapsed = time.perf_counter() - t0
        if need_exact:
            exact_outputs = [(p, list(o.token_ids)) for p, o in zip(prompts[: cfg.exact_prompts], outs)]
        if key not in results["datasets"]:
            m = engine.spec_metrics.as_dict()
            results["datasets"][key] = {
                "num_prompts": len(prompts),
                "num_output_tokens": sum(len(o.token_ids) for o in outs),
                "elapsed_s": round(elapsed, 2),
                "metrics": m,
            }
            log.info("validate: %s (%d prompts): MAL %.3f, per-position %s", name, len(prompts),
                     m["mean_acceptance_length"], m["per_position_acceptance"])  # fmt: skip
            write_json(path, results)
    del engine
    if exact_outputs:
        plain = _engine(cfg, None, max_model_len)
        ref = plain.generate([p for p, _ in exact_outputs], params)
        mismatches = [
            i for i, ((_, got), r) in enumerate(zip(exact_outputs, ref)) if got != list(r.token_ids)
        ]
        results["exact"] = {
            "num_prompts": len(exact_outputs),
            "all_equal": not mismatches,
            "mismatches": mismatches,
        }
        if mismatches:
            log.warning("validate: speculative output differs from plain decoding (%s) on prompts %s",
                        results["dtype"], mismatches)  # fmt: skip
        write_json(path, results)
    return True


def _prompt_ids(engine, name: str, limit: int | None, max_len: int) -> list[list[int]]:
    out = []
    for p in load_prompts(name, limit):  # type: ignore[arg-type]
        ids = (
            engine.apply_chat_template([{"role": "user", "content": p["prompt"]}])
            if p["chat"]
            else engine.encode(p["prompt"])
        )
        if len(ids) < max_len:
            out.append(ids)
    return out
