"""Stage (a): the target answers the training prompts with flexspec's own engine (its chat template).

Resumable: prompts whose id is already in a shard are skipped; the prompt plan (which prompts, in which order)
is a pure function of the config. Optionally the target first writes ``self_prompts`` new prompts in the style
of the training prompts (``data/self_prompts.jsonl``), which join the plan as ``self:<n>``. Sampling settings,
sources and counts go to ``data/meta.json``.
"""

from __future__ import annotations

import json
import random
import zlib
from pathlib import Path
from typing import Any

from flexspec.train.config import TrainConfig, TrainInputError
from flexspec.train.data import ShardWriter, data_dir, read_jsonl, read_rows, write_json
from flexspec.train.progress import Deadline, Progress, log
from flexspec.train.prompts import Prompt, clean_self_prompt, plan_prompts, self_prompt_request

SELF_PROMPT_SAMPLING = {"temperature": 1.0, "top_p": 0.95, "max_tokens": 128}
# Prompts per engine call, in batches of ``gen_batch_size``: the engine keeps ``gen_batch_size`` requests running
# and admits the next prompt as soon as one finishes (continuous batching), so only the call's last batch runs
# short. With one batch per call every batch waited for its longest response (<= max_new_tokens) while the
# others had finished: GSM8K-train responses average ~210 of 384 tokens, so about half of the decode slots
# idled. The deadline is checked between calls and shards are written per call. Self-written prompts likewise.
CHUNK_BATCHES = 4


def engine_for(cfg: TrainConfig, max_model_len: int):
    from configs import EngineConfig
    from flexspec.engine.llm_engine import LLMEngine

    sizes = sorted({1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256} | {cfg.gen_batch_size})
    return LLMEngine(
        EngineConfig(
            model=cfg.target,
            device=cfg.device,
            max_model_len=max_model_len,
            max_num_seqs=min(cfg.gen_batch_size, 1024),
            max_num_batched_tokens=max(8192, max_model_len, cfg.gen_batch_size),
            cuda_graph_batch_sizes=[b for b in sizes if b <= cfg.gen_batch_size],
            seed=cfg.seed,
        )
    )


def sampling_settings(cfg: TrainConfig) -> dict[str, Any]:
    return {
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
        "max_tokens": cfg.max_new_tokens,
    }


def prompt_seed(cfg: TrainConfig, prompt_id: str) -> int:
    """Per-prompt sampling seed: the same response whatever the batch it lands in."""
    return (zlib.crc32(prompt_id.encode()) ^ (cfg.seed * 2654435761)) & 0x7FFFFFFF


def run_generate(cfg: TrainConfig, deadline: Deadline) -> bool:
    """Generate missing responses. Returns True when every planned prompt is done."""
    from configs import SamplingParams

    root = cfg.dir
    plan = plan_prompts(cfg.prompts, cfg.num_prompts, cfg.seed)
    done = {r["id"] for r in read_rows(root)}
    self_path = data_dir(root) / "self_prompts.jsonl"
    self_rows = list(read_jsonl(self_path))
    have_self = len(self_rows)
    # Self-prompt ids are known only once they exist: responses still missing for any of them need the engine.
    self_ids = [r["id"] for r in self_rows[: cfg.self_prompts]]
    need_engine = cfg.self_prompts > have_self or any(i not in done for i in [p.id for p in plan] + self_ids)
    engine = None
    if need_engine:
        engine = engine_for(cfg, cfg.max_prompt_tokens + cfg.max_new_tokens)
    if cfg.self_prompts > have_self:
        assert engine is not None
        if not _self_prompts(cfg, engine, plan, self_path, deadline):
            _write_meta(cfg, plan, root, complete=False)
            return False
    plan = plan + [Prompt(r["id"], r["prompt"]) for r in list(read_jsonl(self_path))[: cfg.self_prompts]]
    todo = [p for p in plan if p.id not in done]
    if not todo:
        _write_meta(cfg, plan, root, complete=True)
        log.info("generate: all %d prompts done", len(plan))
        return True
    assert engine is not None
    writer = ShardWriter(root, cfg.shard_size)
    base = sampling_settings(cfg)
    log.info("generate: %d of %d prompts to go (sampling %s)", len(todo), len(plan), base)
    chunk_size = cfg.gen_batch_size * CHUNK_BATCHES
    with Progress(len(plan), "generate", initial=len(plan) - len(todo), unit="prompt") as bar:
        for start in range(0, len(todo), chunk_size):
            if deadline.expired():
                _write_meta(cfg, plan, root, complete=False)
                return False
            chunk = todo[start : start + chunk_size]
            rows: list[dict[str, Any]] = []
            ids_list, params, kept = [], [], []
            for p in chunk:
                ids = (
                    engine.apply_chat_template([{"role": "user", "content": p.text}])
                    if p.chat
                    else engine.encode(p.text)
                )
                if len(ids) > cfg.max_prompt_tokens:
                    rows.append({"id": p.id, "prompt": p.text, "chat": p.chat, "skipped": "prompt too long"})
                    continue
                ids_list.append(ids)
                params.append(SamplingParams(**base, seed=prompt_seed(cfg, p.id)))
                kept.append(p)
            outs = engine.generate(ids_list, params) if ids_list else []
            for p, ids, o in zip(kept, ids_list, outs):
                rows.append(
                    {
                        "id": p.id,
                        "prompt": p.text,
                        "chat": p.chat,
                        "prompt_ids": ids,
                        "response_ids": list(o.token_ids),
                        "finish_reason": o.finish_reason,
                    }
                )
            writer.write(rows)
            ntok = sum(len(r.get("response_ids", [])) for r in rows)
            bar.update(len(chunk), tokens=ntok)
    _write_meta(cfg, plan, root, complete=True)
    return True


def _self_prompts(cfg: TrainConfig, engine, plan: list[Prompt], path: Path, deadline: Deadline) -> bool:
    """Ask the target for new prompts modelled on random training prompts until ``cfg.self_prompts`` exist."""
    from configs import SamplingParams

    rows = list(read_jsonl(path))
    seen = {r["prompt"] for r in rows}
    attempt = max((r["attempt"] for r in rows), default=-1) + 1
    examples = [p for p in plan if p.chat] or plan
    if not examples:
        raise TrainInputError("self-generated prompts need at least one training prompt as an example")
    path.parent.mkdir(parents=True, exist_ok=True)
    with Progress(cfg.self_prompts, "self-prompts", initial=len(rows), unit="prompt") as bar:
        while len(rows) < cfg.self_prompts and attempt < 4 * cfg.self_prompts + 16:
            if deadline.expired():
                return False
            n = min(cfg.gen_batch_size * CHUNK_BATCHES, 2 * (cfg.self_prompts - len(rows)))
            picks = [
                examples[random.Random(cfg.seed * 7919 + attempt + i).randrange(len(examples))]
                for i in range(n)
            ]
            reqs = [
                engine.apply_chat_template([{"role": "user", "content": self_prompt_request(p.text)}])
                for p in picks
            ]
            params = [
                SamplingParams(**SELF_PROMPT_SAMPLING, seed=prompt_seed(cfg, f"self-request:{attempt + i}"))
                for i in range(n)
            ]
            outs = engine.generate(reqs, params)
            new = []
            for i, (p, o) in enumerate(zip(picks, outs)):
                text = clean_self_prompt(o.text)
                if text is None or text in seen or len(rows) + len(new) >= cfg.self_prompts:
                    continue
                seen.add(text)
                new.append(
                    {
                        "id": f"self:{len(rows) + len(new)}",
                        "prompt": text,
                        "example_id": p.id,
                        "attempt": attempt + i,
                    }
                )
            attempt += n
            with path.open("a") as f:
                for r in new:
                    f.write(json.dumps(r, ensure_ascii=False) + "\n")
            rows += new
            bar.update(len(new))
    if len(rows) < cfg.self_prompts:
        log.warning("self-prompts: only %d usable of %d asked (the target's replies were too short or "
                    "repeated)", len(rows), cfg.self_prompts)  # fmt: skip
    return True


def _write_meta(cfg: TrainConfig, plan: list[Prompt], root: Path, complete: bool) -> None:
    rows = read_rows(root)
    by_source: dict[str, int] = {}
    for r in rows:
        if not r.get("skipped"):
            src = r["id"].rsplit(":", 1)[0]
            by_source[src] = by_source.get(src, 0) + 1
    write_json(
        data_dir(root) / "meta.json",
        {
            "target": cfg.target,
            "engine": "flexspec LLMEngine",
            "chat_template": True,
            "sampling": sampling_settings(cfg),
            "per_prompt_seed": "crc32(prompt id) ^ (seed * 2654435761)",
            "seed": cfg.seed,
            "max_prompt_tokens": cfg.max_prompt_tokens,
            "sources": cfg.prompts,
            "num_prompts": cfg.num_prompts,
            "self_prompts": {"count": cfg.self_prompts, "sampling": SELF_PROMPT_SAMPLING}
            if cfg.self_prompts
            else None,
            "num_planned": len(plan),
            "num_done": len(rows),
            "num_skipped": sum(1 for r in rows if r.get("skipped")),
            "num_samples_by_source": by_source,
            "num_response_tokens": sum(len(r.get("response_ids", [])) for r in rows),
            "complete": complete,
        },
    )
