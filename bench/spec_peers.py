"""Peers of the speculative-decoding benchmark (``bench.spec_bench --peer``): transformers systems of
``bench.hf_peers`` in this process, and vLLM through ``bench/vllm_peer.py`` in its own interpreter.

Each runner appends its points to the same report as our engine's, with ``"peer"`` set, so ``add_ratios`` can
relate them to their own baseline and to our plain engine.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from bench.common import Budget, JsonReport, cycle_to, log, module_available, short_error


def run_hf_peers(
    args: argparse.Namespace,
    model_dir: str,
    systems: list[dict[str, Any]],
    prompts: dict[str, list[list[int]]],
    report: JsonReport,
    budget: Budget,
) -> None:
    """transformers peers: plain systems for every point; prompt lookup per ngram config and assisted
    generation per draft_model config (batch 1 only, skipped with the reason otherwise)."""
    import torch

    from bench.engine_load import release_device_memory
    from bench.hf_peers import HFPeer, Unsupported, run_requests
    from flexspec.models.loader import resolve_model_dir

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {
        "auto": torch.bfloat16 if device == "cuda" else torch.float32,
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
    }[args.dtype]
    peer = HFPeer(model_dir, device, dtype)
    jobs: list[tuple[str, str, dict[str, Any]]] = []  # (label, hf system, kwargs)
    for name in dict.fromkeys(args.peer):
        if name == "vllm":
            continue
        hf_name = "hf_dynamic" if name == "hf" else name
        if hf_name == "hf_prompt_lookup":
            for s in systems:
                if s["config"]["method"] == "ngram":
                    kw = {
                        "num_speculative_tokens": s["num_speculative_tokens"],
                        "max_matching_ngram_size": s["config"].get("prompt_lookup_max"),
                    }
                    jobs.append((f"hf_prompt_lookup-{s['label']}", hf_name, kw))
        elif hf_name == "hf_assisted":
            for s in systems:
                if s["config"]["method"] == "draft_model":
                    kw = {
                        "num_speculative_tokens": s["num_speculative_tokens"],
                        "assistant_dir": str(resolve_model_dir(s["config"]["model"])),
                    }
                    jobs.append((f"hf_assisted-{s['label']}", hf_name, kw))
        else:
            jobs.append((hf_name, hf_name, {}))
    for label, hf_name, kw in jobs:
        for dataset, ds_prompts in prompts.items():
            pad_to = max(len(p) for p in ds_prompts)
            for b in args.batch_sizes:
                point = {
                    "mode": "engine",
                    "peer": "transformers",
                    "dataset": dataset,
                    "system": label,
                    "method": hf_name,
                    "num_speculative_tokens": kw.get("num_speculative_tokens"),
                    "batch_size": b,
                }
                if budget.exhausted():
                    report.doc["runs"].append({**point, "skipped": "time budget exhausted"})
                    continue
                try:
                    reqs = cycle_to(ds_prompts, max(min(args.num_prompts, args.peer_max_prompts), b))
                    rec = run_requests(
                        peer,
                        hf_name,
                        reqs,
                        b,
                        args.max_tokens,
                        args.temperature,
                        args.ignore_eos,
                        pad_to,
                        **kw,
                    )
                    rec.pop("token_ids", None)
                    point.update(rec)
                    log(f"{label} {dataset} b={b}: {rec['output_tokens_per_s']} tok/s")
                except Unsupported as e:
                    point["skipped"] = str(e)
                except Exception as e:  # noqa: BLE001 - a failing peer is a result
                    point["error"] = short_error(e)
                    peer.reset_compile()
                report.doc["runs"].append(point)
                report.save()
        peer.reset_compile()
    del peer
    release_device_memory()


def run_vllm(
    args: argparse.Namespace,
    model_dir: str,
    systems: list[dict[str, Any]],
    prompts: dict[str, list[list[int]]],
    report: JsonReport,
    budget: Budget,
) -> None:
    """vLLM peer: ``bench/vllm_peer.py`` in a subprocess per system (its own interpreter / venv and its own
    GPU memory). Skipped, with the reason recorded, when vLLM is not importable."""
    import subprocess
    import tempfile
    from pathlib import Path

    python = args.vllm_python or sys.executable
    if args.vllm_python is None and not module_available("vllm"):
        report.doc["runs"].append(
            {
                "mode": "engine",
                "peer": "vllm",
                "system": "vllm",
                "skipped": "vllm is not importable here (pass --vllm-python)",
            }
        )
        report.save()
        return
    script = Path(__file__).with_name("vllm_peer.py")
    dtype = args.dtype
    if dtype == "auto":  # the dtype our engine used: float32 on CPU, bfloat16 on GPU
        import torch

        cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        dtype = "bfloat16" if cuda else "float32"
    jobs = [{"label": "vllm", "config": None}]
    jobs += [{"label": f"vllm-{s['label']}", "config": s["config"]} for s in systems]
    for system in jobs:
        if budget.exhausted():
            report.doc["runs"].append(
                {
                    "mode": "engine",
                    "peer": "vllm",
                    "system": system["label"],
                    "skipped": "time budget exhausted",
                }
            )
            continue
        job = {
            "model": model_dir,
            "dtype": dtype,
            "temperature": args.temperature,
            "max_tokens": args.max_tokens,
            "ignore_eos": args.ignore_eos,
            "seed": args.seed,
            "batch_sizes": args.batch_sizes,
            "num_prompts": args.num_prompts,
            "max_model_len": args.max_model_len,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "prompts": prompts,
            "systems": [system],
        }
        with tempfile.TemporaryDirectory() as tmp:
            inp, out = Path(tmp) / "job.json", Path(tmp) / "out.json"
            inp.write_text(json.dumps(job))
            log(f"{system['label']}: running vLLM with {python}")
            proc = subprocess.run(
                [python, str(script), str(inp), str(out)], capture_output=True, text=True, check=False
            )
            if proc.returncode != 0 or not out.is_file():
                tail = (proc.stderr or proc.stdout)[-1500:]
                report.doc["errors"].append(
                    {"system": system["label"], "stage": "vllm subprocess", "error": tail}
                )
            else:
                result = json.loads(out.read_text())
                report.doc["runs"].extend(result.get("runs", []))
                report.doc["env"]["vllm"] = result.get("env")
        report.save()
