"""Engine benchmark (issue 2): output tokens/s of our engine vs transformers at batch 1/8/32/64, same prompts,
dtype and greedy decoding, fixed output length (``ignore_eos``), plus our batch-1 decode step time.

    python -m bench.engine_bench --model-dir DIR --batch-sizes 1,8,32,64 --output out.json

Batch b = b real prompts (GSM8K / HumanEval / MT-Bench interleaved, cycled if needed) submitted at once, each
generating ``--max-tokens`` tokens; tokens/s = b * max_tokens / wall time (prefill included), median of
``--repeats`` runs after a warm-up. transformers runs the same b prompts in one ``generate`` call.

Batch-1 decode step time is reported three ways: ``engine_step_ms`` (one ``LLMEngine.step()`` of a decoding
request, all host work included), ``execute_ms`` (``ModelRunner.execute``: forward + sampling + token readback)
and ``forward_ms`` (``ModelRunner.forward`` only; CUDA events on GPU), each a median.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench.cli import main_entry
from bench.common import (
    Budget,
    JsonReport,
    apply_cpu_threads,
    cuda_graph_summary,
    cycle_to,
    environment,
    int_list,
    log,
    median,
    output_path,
    prompt_token_ids,
    short_error,
)
from bench.hf_peers import (
    DEFAULT_SYSTEM_BUDGET_S,
    HF_SYSTEMS,
    HFPeer,
    PeerTimeout,
    SystemBudget,
    Unsupported,
    matching_fraction,
    run_requests,
)

OURS = "flexspec"
GPU_SYSTEMS = (OURS, "hf_dynamic", "hf_static_compile", "hf_static_compile_default")
CPU_SYSTEMS = (OURS, "hf_dynamic")


def build_parser(prog: str = "python -m bench.engine_bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model-dir", default="smollm2-135m-instruct", help="HF folder, .gguf file or built-in id."
    )
    p.add_argument("--batch-sizes", type=int_list, default=[1, 8, 32, 64])
    p.add_argument("--max-tokens", type=int, default=128, help="Output tokens per request (ignore_eos).")
    p.add_argument("--datasets", default="gsm8k,humaneval,mt_bench", help="Prompt sets, interleaved.")
    p.add_argument(
        "--max-prompt-len", type=int, default=512, help="Keep the last N tokens of longer prompts."
    )
    p.add_argument(
        "--systems", default=None, help=f"Comma list from {(OURS, *HF_SYSTEMS[:5])}; default by device."
    )
    p.add_argument(
        "--peer-time-budget-s",
        type=float,
        default=DEFAULT_SYSTEM_BUDGET_S,
        help="Per transformers system (compile + all its points); later points are skipped (0 = off).",
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="Timed runs per batch size for our engine (median)."
    )
    p.add_argument("--hf-repeats", type=int, default=1, help="Timed runs per batch size for transformers.")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="auto = bfloat16 on GPU, float32 on CPU (both systems).",
    )
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--enforce-eager", action="store_true", help="Our engine without CUDA graphs.")
    p.add_argument(
        "--no-async-output-processing",
        action="store_true",
        help="Our engine with synchronous steps (no overlap of output processing with the next forward).",
    )
    p.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="Our engine without async scheduling (each step scheduled after the previous step's readback).",
    )
    p.add_argument("--decode-step-iters", type=int, default=200)
    p.add_argument(
        "--time-budget-s",
        type=float,
        default=0,
        help="Skip measurements starting this long after the model is prepared (0 = off).",
    )
    p.add_argument(
        "--output", type=output_path, default=None, help="JSON file (rewritten after every measurement)."
    )
    p.add_argument(
        "--cpu-threads", type=int, default=None, help="torch.set_num_threads on CPU (default: torch's)."
    )
    p.add_argument("--no-progress", action="store_true")
    return p


def resolve_device_dtype(device: str, dtype: str) -> tuple[str, str, Any]:
    import torch

    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    name = ("bfloat16" if dev == "cuda" else "float32") if dtype == "auto" else dtype
    return dev, name, getattr(torch, name)


def mixed_prompts(tokenizer: Any, datasets: list[str], n: int, max_prompt_len: int) -> list[list[int]]:
    """``n`` prompts taking one from each dataset in turn."""
    per = [prompt_token_ids(tokenizer, d, -(-n // len(datasets)), max_prompt_len) for d in datasets]
    out = [per[j][i] for i in range(max(len(x) for x in per)) for j in range(len(per)) if i < len(per[j])]
    return cycle_to(out, n)


def time_decode_step(runner: Any, inp: Any, iters: int) -> dict[str, Any]:
    """Median time of one batch-1 decode step replayed in isolation (the captured input's KV slot is
    rewritten with the same values each time). An input scheduled ahead (async scheduling: placeholder ids,
    gathered on the device from the previous step's) is replayed with token id 0 instead."""
    import dataclasses

    import torch

    if inp.prev_token_rows is not None:
        inp = dataclasses.replace(inp, input_ids=[0] * inp.num_tokens, prev_token_rows=None)

    cuda = runner.device.type == "cuda"
    res: dict[str, Any] = {"timer": "cuda_events" if cuda else "perf_counter", "iters": iters}
    graphs = getattr(runner, "graphs", None) or []
    graphs = graphs if isinstance(graphs, list) else [graphs]  # one DecodeGraphs, or one per query length
    res["cuda_graph"] = any(g.can_run(inp) for g in graphs)
    for name, fn in (
        ("forward_ms", lambda: runner.forward(inp)),
        ("execute_ms", lambda: runner.execute(inp)),
    ):
        for _ in range(10):
            fn()
        times = []
        if cuda:
            torch.cuda.synchronize()
            for _ in range(iters):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
        else:
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        res[name] = round(median(times), 4)
    return res


def bench_ours(
    args: argparse.Namespace,
    model: str,
    dtype: str,
    prompts: list[list[int]],
    report: JsonReport,
    budget: Budget,
) -> None:
    from bench.engine_load import StepTimers, release_device_memory, run_closed_loop
    from configs import EngineConfig, SamplingParams
    from flexspec.engine.gc_heap import freeze_long_lived
    from flexspec.engine.llm_engine import LLMEngine

    results = report.doc["results"].setdefault(OURS, {})
    max_bs = max(args.batch_sizes)
    t0 = time.perf_counter()
    engine = LLMEngine(
        EngineConfig(
            model=model,
            dtype=dtype,  # type: ignore[arg-type]
            device=args.device,
            max_model_len=args.max_model_len,
            max_num_seqs=max_bs,
            max_num_batched_tokens=max(2048, max_bs),
            enforce_eager=args.enforce_eager,
            async_output_processing=not args.no_async_output_processing,
            async_scheduling=False if args.no_async_scheduling else None,
            cuda_graph_batch_sizes=sorted({1, 2, 4, 8, 16, 24, 32, 48, 64, *args.batch_sizes}),
            gpu_memory_utilization=args.gpu_memory_utilization,
        )
    )
    report.doc["config"]["flexspec_engine_init_s"] = round(time.perf_counter() - t0, 2)
    freeze_long_lived()  # as the Serve replica does (flexspec.engine.gc_heap)
    report.doc["config"]["flexspec_cuda_graphs"] = cuda_graph_summary(engine)
    timers = StepTimers(engine)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    run_closed_loop(engine, timers, prompts[:max_bs], [warm] * max_bs, max_bs, "flexspec warm-up", False)
    run_closed_loop(engine, timers, prompts[:1], [warm], 1, "flexspec warm-up", False)
    show = not args.no_progress
    for b in args.batch_sizes:
        if budget.exhausted():
            results[str(b)] = {"skipped": "time budget exhausted"}
            continue
        runs = [
            run_closed_loop(engine, timers, prompts[:b], [params] * b, b, f"flexspec b={b} #{r}", show)
            for r in range(args.repeats)
        ]
        steps = [s for r in runs for s in r.steps]
        results[str(b)] = {
            "output_tokens_per_s": round(median(r.output_tokens_per_s for r in runs), 3),
            "output_tokens_per_s_runs": [round(r.output_tokens_per_s, 3) for r in runs],
            "wall_s_runs": [round(r.wall_s, 4) for r in runs],
            "output_tokens": runs[0].output_tokens,
            "step_time": timers.summary(steps),
            "latency": runs[-1].latency(),
            "token_ids": runs[-1].token_ids,
        }
        log(f"flexspec b={b}: {results[str(b)]['output_tokens_per_s']} tok/s")
        report.save()
    if timers.last_decode_input is not None:
        b1 = results.get("1", {}).get("step_time", {}).get("decode_steps") or {}
        step = time_decode_step(engine.executor.runner, timers.last_decode_input, args.decode_step_iters)
        step["engine_step_ms"] = b1.get("step_ms_p50")
        report.doc["decode_step_batch1"] = step
        log(f"batch-1 decode step: {step}")
    report.save()
    timers.remove()
    del timers, engine
    release_device_memory()


def bench_hf(
    args: argparse.Namespace,
    model_dir: str,
    systems: list[str],
    torch_dtype: Any,
    prompts: list[list[int]],
    report: JsonReport,
    budget: Budget,
) -> None:
    from bench.engine_load import release_device_memory

    t0 = time.perf_counter()
    peer = HFPeer(model_dir, args.device_resolved, torch_dtype)
    report.doc["config"]["hf_load_s"] = round(time.perf_counter() - t0, 2)
    pad_to = max(len(p) for p in prompts[: max(args.batch_sizes)])
    for system in systems:
        results = report.doc["results"].setdefault(system, {})
        sys_budget = SystemBudget(system, args.peer_time_budget_s)
        for b in args.batch_sizes:
            if budget.exhausted():
                results[str(b)] = {"skipped": "time budget exhausted"}
                report.save()
                continue
            try:
                runs = [
                    run_requests(
                        peer,
                        system,
                        prompts[:b],
                        b,
                        args.max_tokens,
                        0.0,
                        True,
                        pad_to,
                        warmup=(r == 0),
                        budget=sys_budget,
                    )
                    for r in range(args.hf_repeats)
                ]
                rec = runs[0]
                rec["output_tokens_per_s_runs"] = [r["output_tokens_per_s"] for r in runs]
                rec["output_tokens_per_s"] = median(rec["output_tokens_per_s_runs"])
                ref = report.doc["results"].get("hf_dynamic", {}).get(str(b), {}).get("token_ids")
                if system != "hf_dynamic" and ref:
                    rec["matches_hf_dynamic"] = matching_fraction(rec["token_ids"], ref)
                results[str(b)] = rec
                log(f"{system} b={b}: {rec['output_tokens_per_s']} tok/s (warm-up {rec['warmup_s']} s)")
            except Unsupported as e:
                results[str(b)] = {"skipped": str(e)}
            except PeerTimeout as e:
                results[str(b)] = {"skipped": str(e)}
                log(f"{system} b={b} skipped: {e}")
                peer.reset_compile()
            except Exception as e:  # noqa: BLE001 - a failing peer is a result, not a crash
                results[str(b)] = {"error": short_error(e)}
                log(f"{system} b={b} failed: {short_error(e, 200)}")
                peer.reset_compile()
            report.save()
        peer.reset_compile()
    del peer
    release_device_memory()


def summarize(doc: dict[str, Any], batch_sizes: list[int]) -> dict[str, Any]:
    """Best transformers setting per batch size, our speedup over it, and issue 2's targets."""
    res = doc["results"]
    ours = res.get(OURS, {})
    out: dict[str, Any] = {"best_hf": {}, "speedup_vs_best_hf": {}, "token_agreement_with_hf_dynamic": {}}
    for b in map(str, batch_sizes):
        cands = [
            (s, r[b]["output_tokens_per_s"])
            for s, r in res.items()
            if s != OURS and b in r and r[b].get("output_tokens_per_s")
        ]
        if cands:
            best = max(cands, key=lambda x: x[1])
            out["best_hf"][b] = {"system": best[0], "output_tokens_per_s": best[1]}
            if ours.get(b, {}).get("output_tokens_per_s"):
                out["speedup_vs_best_hf"][b] = round(ours[b]["output_tokens_per_s"] / best[1], 3)
        hf = res.get("hf_dynamic", {}).get(b, {}).get("token_ids")
        mine = ours.get(b, {}).get("token_ids")
        if hf and mine:
            fracs = []
            for x, y in zip(mine, hf):
                n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
                fracs.append(n / max(len(x), 1))
            out["token_agreement_with_hf_dynamic"][b] = round(sum(fracs) / len(fracs), 4)
    step = doc.get("decode_step_batch1", {})
    sp = out["speedup_vs_best_hf"]
    out["targets"] = {
        "batch1_speedup_ge_3x": sp.get("1", 0) >= 3 if "1" in sp else None,
        "batch32_speedup_ge_10x": sp.get("32", 0) >= 10 if "32" in sp else None,
        "batch1_decode_step_le_0.5ms": (step["engine_step_ms"] <= 0.5)
        if step.get("engine_step_ms")
        else None,
        "batch1_forward_le_0.5ms": (step["forward_ms"] <= 0.5) if step.get("forward_ms") else None,
    }
    return out


def main(argv: list[str] | None = None, prog: str = "python -m bench.engine_bench") -> dict[str, Any]:
    args = build_parser(prog).parse_args(argv)
    apply_cpu_threads(args.cpu_threads)
    from transformers import AutoTokenizer

    from flexspec.models.loader import resolve_model_dir

    budget = Budget(args.time_budget_s)
    device, dtype_name, torch_dtype = resolve_device_dtype(args.device, args.dtype)
    args.device_resolved = device
    systems = (
        args.systems.split(",") if args.systems else list(GPU_SYSTEMS if device == "cuda" else CPU_SYSTEMS)
    )
    unknown = [s for s in systems if s != OURS and s not in HF_SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown system(s) {unknown}; known: {(OURS, *HF_SYSTEMS)}")
    model_dir = str(resolve_model_dir(args.model_dir))
    prepare_s = budget.restart()  # --time-budget-s counts from the prepared model (a first load dequantizes)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    datasets = [d for d in args.datasets.split(",") if d]
    prompts = mixed_prompts(tokenizer, datasets, max(args.batch_sizes), args.max_prompt_len)
    if max(len(p) for p in prompts) + args.max_tokens > args.max_model_len:
        raise SystemExit("--max-model-len must cover --max-prompt-len + --max-tokens")
    report = JsonReport(
        args.output,
        {
            "schema": "flexspec.bench.engine/1",
            "env": environment(),
            "config": {
                "model": args.model_dir,
                "model_dir": model_dir,
                "prepare_s": round(prepare_s, 1),
                "device": device,
                "dtype": dtype_name,
                "batch_sizes": args.batch_sizes,
                "max_tokens": args.max_tokens,
                "ignore_eos": True,
                "temperature": 0.0,
                "datasets": datasets,
                "num_prompts": len(prompts),
                "prompt_lens": [len(p) for p in prompts],
                "systems": systems,
                "repeats": args.repeats,
                "hf_repeats": args.hf_repeats,
                "peer_time_budget_s": args.peer_time_budget_s,
                "max_model_len": args.max_model_len,
                "enforce_eager": args.enforce_eager,
                "async_output_processing": not args.no_async_output_processing,
                "async_scheduling": not args.no_async_scheduling,
            },
            "results": {},
        },
    )
    report.save()
    if OURS in systems:
        bench_ours(args, model_dir, dtype_name, prompts, report, budget)
    hf_systems = [s for s in systems if s != OURS]
    if hf_systems:
        bench_hf(args, model_dir, hf_systems, torch_dtype, prompts, report, budget)
    report.doc["summary"] = summarize(report.doc, args.batch_sizes)
    for per_batch in report.doc["results"].values():  # token ids served the agreement check only
        for rec in per_batch.values():
            rec.pop("token_ids", None)
    report.doc["elapsed_s"] = round(budget.elapsed, 1)
    report.save()
    log(f"summary: {report.doc['summary']}")
    return report.doc


if __name__ == "__main__":
    main_entry(main)
