"""Speculative-decoding benchmark (issue 7): plain decoding and every configured method on the same prompts, in
one run: output tokens/s, throughput ratio (speculative / plain), MAL, acceptance rate, per-position acceptance,
step-time split (draft / verify / other), TTFT / ITL / TPOT percentiles.

    python -m bench.spec_bench --dataset gsm8k --num-prompts 32 --batch-sizes 1,4,16,64 \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' --output results.json

Modes: ``engine`` (default; offline, in-process ``LLMEngine``, closed loop: ``batch_size`` requests in flight,
a new one added as soon as one finishes, ``max(num_prompts, requests_per_batch * batch_size)`` requests per
point, prompts cycled)
and ``server`` (HTTP load with concurrency C against running OpenAI-compatible servers, see
``bench.server_bench``). Peers (``--peer``, run by ``bench.spec_peers``): transformers systems of
``bench.hf_peers`` (``hf`` = dynamic cache) and ``vllm`` (in a subprocess, skipped with the reason when vLLM is
missing).

A speculative config is vLLM's ``--speculative-config`` JSON (a dict, or a list of dicts; the flag repeats);
an optional ``"label"`` key names the system in the results. ``--sweep-num-speculative-tokens`` runs every
config at each listed K (MAL vs K).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from bench.cli import main_entry
from bench.common import (
    Budget,
    JsonReport,
    apply_cpu_threads,
    cuda_graph_summary,
    cycle_to,
    datasets_arg,
    environment,
    int_list,
    log,
    positive_int,
    prompt_token_ids,
    short_error,
)
from bench.hf_peers import DEFAULT_SYSTEM_BUDGET_S, HF_SYSTEMS
from bench.spec_peers import run_hf_peers, run_vllm

PEERS = ("hf", *HF_SYSTEMS, "vllm")


def build_parser(prog: str = "python -m bench.spec_bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["engine", "server"], default="engine")
    p.add_argument(
        "--model",
        "--model-dir",
        dest="model",
        default="smollm2-135m-instruct",
        help="Target: HF folder, .gguf file or built-in id.",
    )
    p.add_argument(
        "--dataset", type=datasets_arg, default=["gsm8k"], help="gsm8k|math500|humaneval|mt_bench|all|a,b"
    )
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument(
        "--requests-per-batch",
        type=positive_int,
        default=1,
        help="At least this many requests per point per unit of batch size (prompts cycled): longer points at "
        "large batch, so that the batch stays full and start-up transients weigh less.",
    )
    p.add_argument("--batch-sizes", type=int_list, default=[1, 4, 16, 64], help="Concurrency levels.")
    p.add_argument(
        "--speculative-config", action="append", default=[], help="JSON dict or list (repeatable)."
    )
    p.add_argument("--sweep-num-speculative-tokens", type=int_list, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--ignore-eos", action="store_true", help="Fixed output length (default: stop at EOS).")
    p.add_argument("--seed", type=int, default=0, help="Base seed; request i gets seed + i (T > 0).")
    p.add_argument(
        "--max-prompt-len", type=int, default=1024, help="Keep the last N tokens of longer prompts."
    )
    p.add_argument("--peer", action="append", default=[], choices=PEERS, help="Peer system (repeatable).")
    p.add_argument(
        "--peer-max-prompts",
        type=int,
        default=8,
        help="transformers peers: at most this many prompts per point (they are slow at batch 1).",
    )
    p.add_argument(
        "--peer-time-budget-s",
        type=float,
        default=DEFAULT_SYSTEM_BUDGET_S,
        help="Per peer system (transformers: compile + all points; vLLM: its subprocess); 0 = off.",
    )
    p.add_argument("--vllm-python", default=None, help="Python with vLLM installed (default: this one).")
    p.add_argument(
        "--url", action="append", default=[], help="Server mode: LABEL=URL (repeatable; first = baseline)."
    )
    p.add_argument(
        "--served-model", default=None, help="Server mode: model name (default: first of /v1/models)."
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    p.add_argument(
        "--no-mixed-graphs",
        action="store_true",
        help="Run steps that prefill eagerly (cuda_graph_num_tokens=[]): the A/B of mixed-step CUDA graphs.",
    )
    p.add_argument(
        "--warmup", type=int, default=None, help="Warm-up requests per engine (default: max batch)."
    )
    p.add_argument(
        "--time-budget-s", type=float, default=0, help="Skip points starting after this (0 = off)."
    )
    p.add_argument("--output", default=None, help="Results JSON (rewritten after every point).")
    p.add_argument("--plots", default=None, help="Also write PNG plots into this folder.")
    p.add_argument(
        "--cpu-threads", type=int, default=None, help="torch.set_num_threads on CPU (default: torch's)."
    )
    p.add_argument("--no-progress", action="store_true")
    return p


# ---- configurations ------------------------------------------------------------------------------------------
def expand_configs(raw: list[str], sweep: list[int] | None) -> list[dict[str, Any]]:
    """Parse ``--speculative-config`` values into ``{"label", "config_label", "config"}`` systems, validated
    with the engine's schema and expanded over ``sweep``; labels are made unique."""
    from configs.speculative import parse_speculative_config

    configs: list[dict[str, Any]] = []
    for text in raw:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise SystemExit(f"--speculative-config is not valid JSON: {e}: {text!r}") from None
        for item in data if isinstance(data, list) else [data]:
            if not isinstance(item, dict) or "method" not in item:
                raise SystemExit(f"--speculative-config entries must be objects with a method: {item!r}")
            configs.append(item)
    systems = []
    seen: dict[str, int] = {}
    for item in configs:
        item = dict(item)
        base = str(item.pop("label", item["method"]))
        for k in sweep or [None]:
            cfg = dict(item) if k is None else {**item, "num_speculative_tokens": k}
            try:
                parsed = parse_speculative_config(cfg)
            except Exception as e:  # noqa: BLE001 - pydantic names the bad field
                raise SystemExit(f"invalid speculative config {cfg}: {e}") from None
            label = f"{base}-k{parsed.num_speculative_tokens}"
            seen[label] = seen.get(label, 0) + 1
            if seen[label] > 1:
                label = f"{label}-{seen[label]}"
            systems.append(
                {
                    "label": label,
                    "config_label": base,
                    "config": cfg,
                    "num_speculative_tokens": parsed.num_speculative_tokens,
                }
            )
    return systems


# ---- engine-level --------------------------------------------------------------------------------------------
def run_engine_system(
    args: argparse.Namespace,
    model_dir: str,
    system: dict[str, Any],
    prompts: dict[str, list[list[int]]],
    report: JsonReport,
    budget: Budget,
    plain_tokens: dict[tuple[str, int], list[list[int]]],
) -> None:
    """Build one engine (plain or one speculative config) and measure every dataset x batch size."""
    from bench.engine_load import (
        StepTimers,
        release_device_memory,
        run_closed_loop,
        spec_metrics_delta,
        spec_metrics_snapshot,
    )
    from configs import EngineConfig, SamplingParams
    from flexspec.engine.llm_engine import LLMEngine

    label, cfg, k = system["label"], system["config"], system["num_speculative_tokens"]
    max_bs = max(args.batch_sizes)
    try:
        t0 = time.perf_counter()
        engine = LLMEngine(
            EngineConfig(
                model=model_dir,
                dtype=args.dtype,
                device=args.device,
                max_model_len=args.max_model_len,
                max_num_seqs=max_bs,
                max_num_batched_tokens=max(2048, max_bs * ((k or 0) + 1)),
                cuda_graph_batch_sizes=sorted({1, 2, 4, 8, 16, 24, 32, 48, 64, *args.batch_sizes}),
                gpu_memory_utilization=args.gpu_memory_utilization,
                speculative_config=cfg,
                seed=args.seed,
                **({"cuda_graph_num_tokens": []} if args.no_mixed_graphs else {}),
            )
        )
        init_s = time.perf_counter() - t0
        graphs = cuda_graph_summary(engine)
    except Exception as e:  # noqa: BLE001 - a method that cannot load is a recorded result
        report.doc["errors"].append({"system": label, "stage": "engine init", "error": short_error(e)})
        report.save()
        log(f"{label}: engine init failed: {short_error(e, 300)}")
        return
    timers = StepTimers(engine)
    n_warm = max_bs if args.warmup is None else args.warmup
    if n_warm:
        first = next(iter(prompts.values()))
        # 64 tokens: long enough for the auto policy's warm-up (WARMUP_SAMPLES + 1 steps of each mode) to end
        # before timing, and for every Triton kernel of every mode to be compiled.
        warm = SamplingParams(max_tokens=64, temperature=args.temperature, ignore_eos=True, seed=args.seed)
        run_closed_loop(engine, timers, cycle_to(first, n_warm), [warm] * n_warm, max_bs, "warm-up", False)
        # Then a short run at every measured batch size: prefills of 1, 4, 16, ... prompts at once have their
        # own shapes (eager kernels compile per shape class); a first compile inside a timed point cost ~1.4 s
        # (a 0.2-0.4x outlier at b=4 in earlier runs).
        # Twice as many requests as the batch holds, so that new requests also join a running batch (mixed
        # prefill + decode steps, the shapes of a point with --requests-per-batch > 1).
        short = SamplingParams(max_tokens=8, temperature=args.temperature, ignore_eos=True, seed=args.seed)
        for b in args.batch_sizes:
            run_closed_loop(engine, timers, cycle_to(first, 2 * b), [short] * (2 * b), b, "warm-up", False)
    for dataset, ds_prompts in prompts.items():
        for b in args.batch_sizes:
            point = {
                "mode": "engine",
                "dataset": dataset,
                "system": label,
                "config_label": system["config_label"],
                "method": cfg["method"] if cfg else "plain",
                "num_speculative_tokens": k,
                "speculative_config": cfg,
                "batch_size": b,
                "engine_init_s": round(init_s, 2),
                "cuda_graphs": graphs,
            }
            if budget.exhausted():
                report.doc["runs"].append({**point, "skipped": "time budget exhausted"})
                continue
            reqs = cycle_to(ds_prompts, max(args.num_prompts, args.requests_per_batch * b))
            params = [
                SamplingParams(
                    max_tokens=args.max_tokens,
                    temperature=args.temperature,
                    ignore_eos=args.ignore_eos,
                    seed=args.seed + i,
                )
                for i in range(len(reqs))
            ]
            before = spec_metrics_snapshot(engine)
            policy = getattr(engine, "policy", None)
            modes_before = dict(policy.mode_counts) if policy is not None else {}
            try:
                res = run_closed_loop(
                    engine, timers, reqs, params, b, f"{label} {dataset} b={b}", not args.no_progress
                )
            except Exception as e:  # noqa: BLE001
                report.doc["runs"].append({**point, "error": short_error(e)})
                report.save()
                log(f"{label} {dataset} b={b} failed: {short_error(e, 300)}")
                break
            point.update(
                num_requests=res.num_requests,
                output_tokens=res.output_tokens,
                wall_s=round(res.wall_s, 4),
                output_tokens_per_s=round(res.output_tokens_per_s, 3),
                spec_decode=spec_metrics_delta(before, spec_metrics_snapshot(engine), k) if cfg else None,
                step_time=timers.summary(res.steps),
                latency=res.latency(),
            )
            if policy is not None:  # how often the per-batch policy chose each mode during this point
                point["policy_decisions"] = {
                    m: c - modes_before.get(m, 0)
                    for m, c in policy.mode_counts.items()
                    if c > modes_before.get(m, 0)
                }
                # the step times it decided with at the end of this point ("mode@bucket" -> ms), and the
                # engine's warm-up profile they started from
                point["policy_step_ms"] = {
                    f"{m}@{b}": round(st.seconds * 1e3, 4) for (m, b), st in sorted(policy.step_times.items())
                }
                point["speculation_profile_ms"] = getattr(engine, "speculation_profile", {})
            if cfg is None:
                plain_tokens[(dataset, b)] = res.token_ids
            elif (dataset, b) in plain_tokens and args.temperature == 0:
                ref = plain_tokens[(dataset, b)]
                point["matches_plain"] = round(sum(x == y for x, y in zip(res.token_ids, ref)) / len(ref), 4)
            report.doc["runs"].append(point)
            report.save()
            sd = point["spec_decode"] or {}
            log(
                f"{label} {dataset} b={b}: {point['output_tokens_per_s']} tok/s"
                + (f", MAL {sd.get('mean_acceptance_length')}" if sd else "")
            )
    timers.remove()
    del timers, engine
    release_device_memory()


def add_ratios(runs: list[dict[str, Any]]) -> None:
    """throughput_ratio = tokens/s of a point / tokens/s of its baseline at the same dataset, batch and mode:
    our plain engine for our methods, transformers dynamic for transformers peers, vLLM plain for vLLM."""
    index = {
        (r.get("mode"), r.get("dataset"), r.get("batch_size"), r.get("system")): r
        for r in runs
        if r.get("output_tokens_per_s")
    }
    for r in runs:
        if not r.get("output_tokens_per_s"):
            continue
        peer = r.get("peer")
        base = {None: "plain", "transformers": "hf_dynamic", "vllm": "vllm"}.get(peer, r.get("baseline"))
        if r.get("mode") == "server":
            base = r.get("baseline")
        key = (r.get("mode"), r.get("dataset"), r.get("batch_size"))
        b = index.get((*key, base))
        if b is not None:
            r["baseline"] = base
            r["throughput_ratio"] = round(r["output_tokens_per_s"] / b["output_tokens_per_s"], 4)
        ours = index.get((*key, "plain"))
        if ours is not None and peer is not None:
            r["ratio_vs_flexspec_plain"] = round(r["output_tokens_per_s"] / ours["output_tokens_per_s"], 4)


def main(argv: list[str] | None = None, prog: str = "python -m bench.spec_bench") -> dict[str, Any]:
    args = build_parser(prog).parse_args(argv)
    apply_cpu_threads(args.cpu_threads)
    budget = Budget(args.time_budget_s)
    systems = expand_configs(args.speculative_config, args.sweep_num_speculative_tokens)
    report = JsonReport(
        args.output,
        {
            "schema": "flexspec.bench.spec/1",
            "env": environment(),
            "config": {
                k: v for k, v in vars(args).items() if k not in ("speculative_config", "output", "plots")
            },
            "systems": [{"label": "plain", "config": None}] + systems,
            "runs": [],
            "errors": [],
        },
    )
    report.save()
    if args.mode == "server":
        from bench.server_bench import run_server

        run_server(args, report, budget)
    else:
        from transformers import AutoTokenizer

        from flexspec.models.loader import resolve_model_dir

        model_dir = str(resolve_model_dir(args.model))
        report.doc["config"]["model_dir"] = model_dir
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        prompts = {
            d: prompt_token_ids(tokenizer, d, args.num_prompts, args.max_prompt_len) for d in args.dataset
        }
        report.doc["config"]["prompt_lens"] = {d: [len(p) for p in ps] for d, ps in prompts.items()}
        plain_tokens: dict[tuple[str, int], list[list[int]]] = {}
        plain = {"label": "plain", "config_label": "plain", "config": None, "num_speculative_tokens": None}
        for system in [plain, *systems]:
            run_engine_system(args, model_dir, system, prompts, report, budget, plain_tokens)
        if any(p != "vllm" for p in args.peer):
            run_hf_peers(args, model_dir, systems, prompts, report, budget)
        if "vllm" in args.peer:
            run_vllm(args, model_dir, systems, prompts, report, budget, plain_tokens)
    add_ratios(report.doc["runs"])
    report.doc["elapsed_s"] = round(budget.elapsed, 1)
    if hasattr(os, "getloadavg"):
        report.doc["env"]["machine"]["loadavg_1_5_15_at_end"] = [round(x, 2) for x in os.getloadavg()]
    report.save()
    if args.plots:
        try:
            from bench.plots import make_plots

            report.doc["plots"] = make_plots([report.doc], args.plots)
        except ImportError as e:  # e.g. no matplotlib on the GPU machine: plot later with bench.plots
            report.doc["plots"] = f"not made: {e}"
        report.save()
    return report.doc


if __name__ == "__main__":
    main_entry(main)
