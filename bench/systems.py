"""The systems a benchmark compares: ``--speculative-config`` values parsed into labelled systems, and one
engine per system built and warmed up the same way for every benchmark (``bench.spec_bench``,
``bench.plain_overhead``)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from bench.common import JsonReport, cuda_graph_summary, cycle_to, log, short_error


def expand_configs(raw: list[str], sweep: list[int] | None) -> list[dict[str, Any]]:
    """Parse ``--speculative-config`` values into ``{"label", "config_label", "config"}`` systems, validated
    with the engine's schema and expanded over ``sweep``. A system is named by its ``"label"`` key as given
    (``-k{N}`` added under a sweep), else ``{method}-k{N}``; a repeated name gets ``-2``, ``-3``, ..."""
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
        named = "label" in item
        base = str(item.pop("label", item["method"]))
        for k in sweep or [None]:
            cfg = dict(item) if k is None else {**item, "num_speculative_tokens": k}
            try:
                parsed = parse_speculative_config(cfg)
            except Exception as e:  # noqa: BLE001 - pydantic names the bad field
                from pydantic import ValidationError

                from flexspec.errors import validation_message

                why = validation_message(e) if isinstance(e, ValidationError) else str(e)
                raise SystemExit(f"error: invalid speculative config {json.dumps(cfg)}: {why}") from None
            label = base if named and sweep is None else f"{base}-k{parsed.num_speculative_tokens}"
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
def build_engine_system(
    args: argparse.Namespace,
    model_dir: str,
    system: dict[str, Any],
    prompts: dict[str, list[list[int]]],
    report: JsonReport,
) -> tuple[Any, Any, dict[str, Any]] | None:
    """Build and warm up one engine (plain or one speculative config). Returns (engine, step timers, the
    fields every point of it carries), or None after recording why it could not be built."""
    from bench.engine_load import StepTimers, run_closed_loop
    from configs import EngineConfig, SamplingParams
    from flexspec.engine.gc_heap import freeze_long_lived
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
        freeze_long_lived()  # as the Serve replica does (flexspec.engine.gc_heap): no full-collection stalls
        graphs = cuda_graph_summary(engine)
    except Exception as e:  # noqa: BLE001 - a method that cannot load is a recorded result
        report.doc["errors"].append({"system": label, "stage": "engine init", "error": short_error(e)})
        report.save()
        log(f"{label}: engine init failed: {short_error(e, 300)}")
        return None
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
    fields = {
        "system": label,
        "config_label": system["config_label"],
        "method": cfg["method"] if cfg else "plain",
        "num_speculative_tokens": k,
        "speculative_config": cfg,
        "engine_init_s": round(init_s, 2),
        "cuda_graphs": graphs,
    }
    return engine, timers, fields
