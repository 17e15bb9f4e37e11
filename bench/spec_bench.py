"""Speculative-decoding benchmark: plain decoding and every configured method on the same prompts, in
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
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from bench.cli import main_entry
from bench.common import (
    Budget,
    JsonReport,
    apply_cpu_threads,
    cycle_to,
    datasets_arg,
    environment,
    int_list,
    log,
    median,
    output_dir,
    output_path,
    positive_int,
    prompt_token_ids,
    short_error,
)
from bench.hf_peers import DEFAULT_SYSTEM_BUDGET_S, HF_SYSTEMS
from bench.spec_peers import run_hf_peers, run_vllm
from bench.systems import build_engine_system, expand_configs

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
        "--time-budget-s",
        type=float,
        default=0,
        help="Skip points starting this many seconds after the model is prepared (0 = off).",
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        help="Engine mode: > 1 keeps every system's engine and runs each point this many rounds, systems "
        "interleaved, reporting each system's median round (see run_interleaved).",
    )
    p.add_argument(
        "--output", type=output_path, default=None, help="Results JSON (rewritten after every point)."
    )
    p.add_argument("--plots", type=output_dir, default=None, help="Also write PNG plots into this folder.")
    p.add_argument(
        "--step-log",
        default=None,
        help="Also write every step of every point (mode, batch, tokens, decode or not, launched, wall / "
        "executor / draft ms) as JSON lines into this folder, one file per system, dataset and batch size.",
    )
    p.add_argument(
        "--cpu-threads", type=int, default=None, help="torch.set_num_threads on CPU (default: torch's)."
    )
    p.add_argument("--no-progress", action="store_true")
    return p


# ---- configurations ------------------------------------------------------------------------------------------
def _record(fields: dict[str, Any], dataset: str, b: int, **extra: Any) -> dict[str, Any]:
    """A point's identifying fields (system, dataset, batch size) plus ``extra``."""
    return {"mode": "engine", "dataset": dataset, **fields, "batch_size": b, **extra}


def measure_point(
    args: argparse.Namespace,
    engine: Any,
    timers: Any,
    fields: dict[str, Any],
    dataset: str,
    b: int,
    ds_prompts: list[list[int]],
) -> dict[str, Any]:
    """One closed-loop run of ``dataset`` at concurrency ``b`` on a built engine: the point's JSON fields (with
    the output ``token_ids``, which ``_finish_point`` compares with plain decoding's and drops). Whatever the
    engine raises propagates (the caller records it)."""
    from bench.engine_load import run_closed_loop, spec_metrics_delta, spec_metrics_snapshot
    from configs import SamplingParams

    cfg, k = fields["speculative_config"], fields["num_speculative_tokens"]
    point = _record(fields, dataset, b)
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
    desc = f"{fields['system']} {dataset} b={b}"
    res = run_closed_loop(engine, timers, reqs, params, b, desc, not args.no_progress)
    point.update(
        num_requests=res.num_requests,
        output_tokens=res.output_tokens,
        wall_s=round(res.wall_s, 4),
        output_tokens_per_s=round(res.output_tokens_per_s, 3),
        spec_decode=spec_metrics_delta(before, spec_metrics_snapshot(engine), k) if cfg else None,
        step_time=timers.summary(res.steps),
        latency=res.latency(),
        token_ids=res.token_ids,
    )
    if args.step_log:
        write_step_log(args.step_log, point, res.steps, args.step_log_rounds)
    if policy is not None:  # how often the per-batch policy chose each mode during this point
        point["policy_decisions"] = {
            m: c - modes_before.get(m, 0) for m, c in policy.mode_counts.items() if c > modes_before.get(m, 0)
        }
        # the step times it decided with at the end of this point ("mode@bucket" -> ms), and the
        # engine's warm-up profile they started from
        point["policy_step_ms"] = policy.estimates_ms()
        point["speculation_profile_ms"] = getattr(engine, "speculation_profile", {})
    return point


def check_step_log(folder: str) -> Path:
    """``--step-log``'s folder, created; raises ValueError (before anything is measured) if it is a file, cannot
    be created or written (``output_dir``), or holds step logs already (appending would mix two runs' steps)."""
    try:
        path = output_dir(folder)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"--step-log: {e}") from None
    if any(path.glob("*.jsonl")):
        raise ValueError(
            f"--step-log {folder}: holds step logs of an earlier run (*.jsonl); give a new folder"
        )
    return path


def write_step_log(folder: str, point: dict[str, Any], steps: list[Any], rounds: dict[Path, int]) -> Path:
    """One JSON line per step of a point (``StepRecord`` fields, times in ms, and ``round``: 0, 1, ... for the
    rounds of ``--repeats``, counted in ``rounds``: file -> rounds written in this run) into
    ``folder/{system}_{dataset}_b{batch}.jsonl`` (path separators in the system's label become ``%2F``)."""
    name = f"{point['system']}_{point['dataset']}_b{point['batch_size']}.jsonl".replace(os.sep, "%2F")
    path = Path(folder) / name
    rnd = rounds.get(path, 0)
    rounds[path] = rnd + 1
    with path.open("a") as f:
        for r in steps:
            r.describe_ranking()
            rec = {"round": rnd, **dataclasses.asdict(r)}
            del rec["ranking"]
            for key in ("wall_s", "exec_s", "draft_s"):
                rec[key.replace("_s", "_ms")] = round(rec.pop(key) * 1e3, 4)
            f.write(json.dumps(rec) + "\n")
    return path


def _finish_point(
    args: argparse.Namespace, point: dict[str, Any], plain_tokens: dict[tuple[str, int], list[list[int]]]
) -> dict[str, Any]:
    """Compare a point's tokens with plain decoding's (T=0) and drop them from the record."""
    key = (point["dataset"], point["batch_size"])
    token_ids = point.pop("token_ids")
    if point["speculative_config"] is None:
        plain_tokens[key] = token_ids
    elif key in plain_tokens and args.temperature == 0:
        ref = plain_tokens[key]
        point["matches_plain"] = round(sum(x == y for x, y in zip(token_ids, ref)) / len(ref), 4)
    return point


def _log_point(point: dict[str, Any]) -> None:
    sd = point.get("spec_decode") or {}
    log(
        f"{point['system']} {point['dataset']} b={point['batch_size']}: {point['output_tokens_per_s']} tok/s"
        + (f", MAL {sd.get('mean_acceptance_length')}" if sd else "")
    )


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
    from bench.engine_load import release_device_memory

    built = build_engine_system(args, model_dir, system, prompts, report)
    if built is None:
        return
    engine, timers, fields = built
    for dataset, ds_prompts in prompts.items():
        for b in args.batch_sizes:
            if budget.exhausted():
                report.doc["runs"].append(_record(fields, dataset, b, skipped="time budget exhausted"))
                continue
            try:
                point = measure_point(args, engine, timers, fields, dataset, b, ds_prompts)
            except Exception as e:  # noqa: BLE001
                err = _record(fields, dataset, b, error=short_error(e))
                report.doc["runs"].append(err)
                report.save()
                log(f"{fields['system']} {dataset} b={b} failed: {short_error(e, 300)}")
                break
            report.doc["runs"].append(_finish_point(args, point, plain_tokens))
            report.save()
            _log_point(point)
    timers.remove()
    del timers, engine
    release_device_memory()


def run_interleaved(
    args: argparse.Namespace,
    model_dir: str,
    systems: list[dict[str, Any]],
    prompts: dict[str, list[list[int]]],
    report: JsonReport,
    budget: Budget,
) -> None:
    """``--repeats R``: every system's engine is built first and kept; then each (dataset, batch size) runs
    R rounds, each round every system once, the order rotated between rounds, and a system's point is its
    median round by tokens/s (all rounds' tokens/s kept in ``repeats_tokens_per_s``). A slow spell of the host
    (on the lent H200, seconds long: the plain engine's b=64 steps moved +-20% between points) then falls on
    every system of a round rather than on one system's point."""
    from bench.engine_load import release_device_memory

    built = []
    for system in systems:
        got = build_engine_system(args, model_dir, system, prompts, report)
        if got is not None:
            built.append(got)
    plain_tokens: dict[tuple[str, int], list[list[int]]] = {}
    failed: set[str] = set()
    for dataset, ds_prompts in prompts.items():
        for b in args.batch_sizes:
            rounds: dict[str, list[dict[str, Any]]] = {f["system"]: [] for _, _, f in built}
            for r in range(args.repeats):
                if budget.exhausted():
                    break
                shift = r % len(built)
                for engine, timers, fields in built[shift:] + built[:shift]:
                    label = fields["system"]
                    if label in failed:
                        continue
                    try:
                        rounds[label].append(
                            measure_point(args, engine, timers, fields, dataset, b, ds_prompts)
                        )
                    except Exception as e:  # noqa: BLE001
                        failed.add(label)
                        err = _record(fields, dataset, b, error=short_error(e))
                        report.doc["runs"].append(err)
                        log(f"{label} {dataset} b={b} failed: {short_error(e, 300)}")
            for _, _, fields in built:  # plain first: the others compare their tokens with its
                runs = rounds[fields["system"]]
                if not runs:
                    if fields["system"] not in failed:
                        report.doc["runs"].append(
                            _record(fields, dataset, b, skipped="time budget exhausted")
                        )
                    continue
                ranked = sorted(runs, key=lambda p: p["output_tokens_per_s"])
                point = dict(ranked[(len(ranked) - 1) // 2])
                point["repeats_tokens_per_s"] = [p["output_tokens_per_s"] for p in runs]
                point["repeats_matches_plain"] = []
                for p in runs:
                    done = _finish_point(args, dict(p), dict(plain_tokens))
                    point["repeats_matches_plain"].append(done.get("matches_plain"))
                report.doc["runs"].append(_finish_point(args, point, plain_tokens))
                _log_point(point)
            report.save()
    for engine, timers, _ in built:
        timers.remove()
    del built
    release_device_memory()


def _paired_ratios(xs: list[float] | None, base: list[float] | None) -> list[float] | None:
    """Round-by-round ratios of two systems' ``--repeats`` rounds (round i of both ran back to back, so a slow
    spell of the host falls on both); None without rounds or when a system missed one (lengths differ)."""
    if not xs or not base or len(xs) != len(base) or len(xs) < 2 or not all(base):
        return None
    return [round(x / y, 4) for x, y in zip(xs, base)]


def add_ratios(runs: list[dict[str, Any]]) -> None:
    """throughput_ratio = tokens/s of a point / tokens/s of its baseline at the same dataset, batch and mode:
    our plain engine for our methods, transformers dynamic for transformers peers, vLLM plain for vLLM. With
    ``--repeats`` > 1 also ``paired_ratios`` (round i over the baseline's round i) and their median
    ``paired_ratio_median``, less sensitive to the host's slow spells than the ratio of the two medians."""
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
            paired = _paired_ratios(r.get("repeats_tokens_per_s"), b.get("repeats_tokens_per_s"))
            if paired:
                r["paired_ratios"] = paired
                r["paired_ratio_median"] = round(median(paired), 4)
        ours = index.get((*key, "plain"))
        if ours is not None and peer is not None:
            r["ratio_vs_flexspec_plain"] = round(r["output_tokens_per_s"] / ours["output_tokens_per_s"], 4)


def main(argv: list[str] | None = None, prog: str = "python -m bench.spec_bench") -> dict[str, Any]:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.step_log:
        if args.mode != "engine":
            parser.error("--step-log: engine mode only (server mode sees HTTP responses, not engine steps)")
        try:
            check_step_log(args.step_log)
        except ValueError as e:
            parser.error(str(e))
    args.step_log_rounds = {}  # step-log file -> rounds written (``--repeats``)
    apply_cpu_threads(args.cpu_threads)
    budget = Budget(args.time_budget_s)
    systems = expand_configs(args.speculative_config, args.sweep_num_speculative_tokens)
    report = JsonReport(
        args.output,
        {
            "schema": "flexspec.bench.spec/1",
            "env": environment(),
            "config": {
                k: v
                for k, v in vars(args).items()
                if k not in ("speculative_config", "output", "plots", "step_log_rounds")
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
        report.doc["config"]["prepare_s"] = round(budget.restart(), 1)  # --time-budget-s counts from here
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        prompts = {
            d: prompt_token_ids(tokenizer, d, args.num_prompts, args.max_prompt_len) for d in args.dataset
        }
        report.doc["config"]["prompt_lens"] = {d: [len(p) for p in ps] for d, ps in prompts.items()}
        plain_tokens: dict[tuple[str, int], list[list[int]]] = {}
        plain = {"label": "plain", "config_label": "plain", "config": None, "num_speculative_tokens": None}
        if args.repeats > 1:
            run_interleaved(args, model_dir, [plain, *systems], prompts, report, budget)
        else:
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
