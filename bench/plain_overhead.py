"""What a loaded drafter costs when the policy does not speculate: plain decoding steps of the plain engine vs
plain steps of speculative engines whose policy is held on plain decoding.

    python -m bench.plain_overhead --batch-sizes 1,8,64 --steps 300 --output plain_overhead.json \\
        --speculative-config '[{"method": "dflash", "model": "smollm2-135m-instruct-dflash"},
                               {"method": "dflash", "model": "smollm2-135m-instruct-dflash",
                                "defer_context": false, "label": "dflash-eager-context"}]'

Issue 6 asks that speculation never make a batch slower than plain decoding: when the policy picks plain
decoding, a step must cost what it costs without a drafter. For each system and batch size the batch is
filled with greedy requests (EOS ignored, GSM8K prompts), prefilled and warmed up, then ``--steps``
``LLMEngine.step()`` calls are timed (wall, one device sync at the end) and ``--profile-steps`` more are run
under torch.profiler: device time (sum of kernel durations) and kernels per step. Every speculative engine
decides plain for every step (its policy's ``decide`` is replaced), so it still keeps its drafter's state up
to date (DFlash: ``defer_context``) as it would between speculative stretches. JSON out, with the
machine; the overhead is each system's time per step over the plain engine's at the same batch size.
``--split-kv 0,auto`` builds one plain engine per split-KV setting instead (an in-process A/B of the attention
kernel's split-KV path, :mod:`flexspec_kernels.attention_split`, in interleaved rounds; ``--decode-first`` for long contexts);
``--fused-decode 1,0`` likewise for the batch-1/2 decode fusions of :mod:`flexspec_kernels.skinny_attention`, and
``--pdl 1,0`` for programmatic dependent launch of the decode kernels (:mod:`flexspec_kernels.pdl`).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "0")

from bench.common import JsonReport, environment, int_list, log, output_path, prompt_token_ids, short_error
from bench.systems import expand_configs


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _HostGaps:
    """Host time per step between the end of one step's ``collect`` (its tokens are on the host) and the next
    ``launch`` / ``execute`` call (output processing, scheduling, the policy's decision, input building): the
    device idles then, since the next step's inputs need this step's tokens."""

    def __init__(self, engine: Any) -> None:
        self.ex = ex = engine.executor
        self.collect_end: float | None = None
        self.gaps: list[float] = []
        self.launch_s: list[float] = []
        collect, launch, execute = ex.collect, ex.launch, ex.execute

        def start(fn):
            def wrapper(inp):
                t = time.perf_counter()
                if self.collect_end is not None:
                    self.gaps.append(t - self.collect_end)
                    self.collect_end = None
                out = fn(inp)
                self.launch_s.append(time.perf_counter() - t)
                if fn is execute:
                    self.collect_end = time.perf_counter()
                return out

            return wrapper

        def collected(pending):
            out = collect(pending)
            self.collect_end = time.perf_counter()
            return out

        ex.collect, ex.launch, ex.execute = collected, start(launch), start(execute)

    def remove(self) -> None:
        del self.ex.collect, self.ex.launch, self.ex.execute

    def summary(self) -> dict[str, float]:
        mean_ms = lambda xs: round(sum(xs) / max(len(xs), 1) * 1e3, 4)
        return {"host_gap_ms_per_step": mean_ms(self.gaps), "launch_ms_per_step": mean_ms(self.launch_s)}


class StubModel:
    """Host work only: the runner's target forward and sampling replaced by an instant stub (``--stub-model``).

    Each emitted token is the next token of a fixed real text (cycled by output position), so detokenization
    and stop checks see ordinary text; nothing is computed on the device. What a step then costs is the
    engine's host work (scheduling, input building, the drafter's and the policy's bookkeeping, output
    processing): a CPU regression number for changes to that work, not a performance claim. Plain steps only
    (speculative steps need real logits)."""

    def __init__(self, engine: Any, text_ids: list[int]) -> None:
        import torch

        from flexspec.engine import model_runner

        global _real_sample
        self.runner, self.module = engine.executor.runner, model_runner
        self.text = torch.tensor(text_ids, dtype=torch.int64)  # [L]
        if _real_sample is None:
            _real_sample = model_runner.sample

        def forward(inp, side=None, prev_tokens=None):  # -> ([N] token ids standing in for logits, [])
            rows = torch.tensor([inp.positions[i] + 1 for i in inp.logits_indices], dtype=torch.int64)
            return self.text[rows % len(self.text)], []

        self.runner.forward = forward
        model_runner.sample = _stub_sample  # the runner's sampler (a module global: every runner here)

    def remove(self) -> None:
        del self.runner.forward
        if _real_sample is not None:
            self.module.sample = _real_sample


_real_sample = None  # flexspec.engine.model_runner.sample while StubModel replaces it


def _stub_sample(logits, meta):  # StubModel's "logits" are the token ids already
    return logits


def fill(
    engine: Any, prompts: list[list[int]], batch_size: int, max_tokens: int, decode_first: int
) -> list[str]:
    """Add ``batch_size`` greedy requests (EOS ignored), prefill them and decode ``10 + decode_first`` steps
    (outputs that long when timing starts); returns the request ids."""
    from configs import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"b{batch_size}-{i}-{time.monotonic_ns()}" for i in range(batch_size)]
    for i, rid in enumerate(ids):
        engine.add_request(prompts[i % len(prompts)], params, request_id=rid)
    for _ in range(64):  # every prompt prefilled, then a few decode steps
        engine.step()
        if (
            all(s.num_computed_tokens >= s.num_prompt_tokens for s in engine.scheduler.running)
            and len(engine.scheduler.running) == batch_size
        ):
            break
    for _ in range(10 + decode_first):
        engine.step()
    _sync()
    return ids


def time_steps(engine: Any, steps: int) -> dict[str, float]:
    """Wall time per step over ``steps`` ``LLMEngine.step()`` calls (one device sync at the end) and the host
    gaps / launch times (``_HostGaps``), in ms."""
    gaps = _HostGaps(engine)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync()
    wall_ms = (time.perf_counter() - t0) / steps * 1e3
    gaps.remove()
    return {"wall_ms_per_step": wall_ms, **gaps.summary()}


def profile_steps(engine: Any, profile_steps: int, cprofile_steps: int) -> dict[str, Any]:
    """``profile_steps`` steps under torch.profiler (device time and kernels per step; CUDA only) and
    ``cprofile_steps`` more under cProfile (the host functions with the most own time)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    point: dict[str, Any] = {}
    if profile_steps and torch.cuda.is_available():
        kernels: dict[str, list[float]] = defaultdict(list)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(profile_steps):
                engine.step()
            _sync()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kernels[e.name].append(getattr(e, "device_time_total", 0.0))
        total = sum(sum(v) for v in kernels.values())
        point["kernel_ms_per_step"] = round(total / profile_steps / 1e3, 4)
        point["kernels_per_step"] = round(sum(len(v) for v in kernels.values()) / profile_steps, 1)
        top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:12]
        point["top_kernels"] = [
            {
                "name": n[:80],
                "ms_per_step": round(sum(v) / profile_steps / 1e3, 4),
                "calls": len(v) / profile_steps,
            }
            for n, v in top
        ]
    if cprofile_steps:  # cProfile slows the host: separate steps
        cprof = cProfile.Profile()
        cprof.enable()
        for _ in range(cprofile_steps):
            engine.step()
        cprof.disable()
        rows = sorted(pstats.Stats(cprof).stats.items(), key=lambda kv: -kv[1][2])[:20]  # type: ignore[attr-defined]
        point["host_top_us_per_step"] = {
            f"{Path(f).name}:{line}({fn})": round(1e6 * tt / cprofile_steps, 1)
            for (f, line, fn), (_, _, tt, _, _) in rows
        }
    return point


def _split_kv_list(text: str) -> list[str]:
    """``--split-kv`` values, each checked as ``FLEXSPEC_SPLIT_KV`` is (argparse reports the error)."""
    from flexspec_kernels.attention_split import parse_split_kv

    try:
        return [parse_split_kv(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _bool_list(text: str) -> list[bool]:
    """``--fused-decode`` / ``--pdl`` values, each read as ``FLEXSPEC_FUSED_DECODE`` is (1 / 0, on / off, ...)."""
    from flexspec_kernels._dispatch import EnvSettingError, env_flag

    parts = [v.strip() for v in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated 1/0 values, got {text!r}")
    try:
        return [env_flag("value", True, {"value": v}) for v in parts]
    except EnvSettingError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: list[str] | None = None, prog: str = "python -m bench.plain_overhead") -> None:
    ap = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--model", default="smollm2-135m-instruct", help="Target model id, folder or .gguf file.")
    ap.add_argument("--batch-sizes", type=int_list, default=[1, 8, 64], help="Comma-separated batch sizes.")
    ap.add_argument("--steps", type=int, default=300, help="Timed steps per system, point and round.")
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="Rounds per point, systems interleaved (rotated); median reported.",
    )
    ap.add_argument("--profile-steps", type=int, default=20, help="Profiled steps per point (0 = none).")
    ap.add_argument(
        "--cprofile-steps", type=int, default=0, help="Steps under cProfile per point (0 = none)."
    )
    ap.add_argument(
        "--speculative-config", action="append", default=[], help="JSON dict or list (repeatable)."
    )
    ap.add_argument(
        "--decode-first", type=int, default=0, help="Decode steps before timing (host cost at long outputs)."
    )
    ap.add_argument(
        "--stub-model",
        action="store_true",
        help="Host work only: target forward + sampling replaced by an instant stub (CPU regression numbers).",
    )
    ap.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CUDA if present."
    )
    ap.add_argument("--num-kv-blocks", type=int, default=None, help="KV-cache blocks (default: from memory).")
    ap.add_argument(
        "--gpu-memory-utilization", type=float, default=None, help="Per engine (default: 0.85 / systems)."
    )
    ap.add_argument("--max-model-len", type=int, default=2048, help="Max prompt + output tokens per request.")
    ap.add_argument(
        "--split-kv",
        type=_split_kv_list,
        default=None,
        help="Comma-separated FLEXSPEC_SPLIT_KV values (e.g. 0,auto): one plain engine each instead of one "
        "plain engine, the first the baseline; the value is baked into each engine's CUDA graphs (decode steps).",
    )
    ap.add_argument(
        "--fused-decode",
        type=_bool_list,
        default=None,
        help="Comma-separated FLEXSPEC_FUSED_DECODE values (e.g. 1,0): one plain engine each (per --split-kv "
        "value too), baked into its CUDA graphs: batch-1/2 decode with RoPE and the split-KV merge inside the "
        "QKV and O GEMVs, or as launches of their own.",
    )
    ap.add_argument(
        "--pdl",
        type=_bool_list,
        default=None,
        help="Comma-separated FLEXSPEC_PDL values (e.g. 1,0): one plain engine each (per --split-kv and "
        "--fused-decode value too), baked into its CUDA graphs: the decode kernels launched with programmatic "
        "dependent launch or not.",
    )
    ap.add_argument(
        "--output", type=output_path, default=None, help="Results JSON (rewritten after every point)."
    )
    args = ap.parse_args(argv)

    import statistics

    from configs import EngineConfig
    from flexspec.engine.gc_heap import freeze_long_lived
    from flexspec.engine.llm_engine import LLMEngine
    from flexspec.layers import fused
    from flexspec.spec.policy import Decision
    from flexspec_kernels import attention_split, pdl

    plain = [{"label": "plain", "config": None}]
    if args.split_kv or args.fused_decode or args.pdl:
        plain = [
            {
                "label": "plain"
                + (f"-split-kv-{v}" if args.split_kv else "")
                + (f"-fused-decode-{int(f)}" if args.fused_decode else "")
                + (f"-pdl-{int(p)}" if args.pdl else ""),
                "config": None,
                "split_kv": v,
                "fused_decode": f,
                "pdl": p,
            }
            for v in args.split_kv or [None]
            for f in args.fused_decode or [None]
            for p in args.pdl or [None]
        ]
    systems = [*plain, *expand_configs(args.speculative_config, None)]
    plain_labels = {s["label"] for s in plain}
    env_split_kv, env_fused_decode = attention_split.split_kv_setting(), fused.DECODE_FUSIONS
    env_pdl = pdl.pdl_setting()
    report = JsonReport(
        args.output,
        {
            "schema": "flexspec.bench.plain_overhead/2",
            "env": environment(),
            "config": vars(args),
            "points": [],
        },
    )
    gpu_share = args.gpu_memory_utilization or round(0.85 / len(systems), 3)
    engines: dict[str, Any] = {}  # every system's engine is kept: rounds interleave them
    for system in systems:
        label = system["label"]
        # read when an engine captures its graphs; eager launches read it at call time (the env's value after)
        attention_split.SPLIT_KV = system.get("split_kv") or env_split_kv
        fused.DECODE_FUSIONS = (
            env_fused_decode if system.get("fused_decode") is None else system["fused_decode"]
        )
        pdl.PDL = env_pdl if system.get("pdl") is None else system["pdl"]
        try:
            engine = LLMEngine(
                EngineConfig(
                    model=args.model,
                    max_model_len=args.max_model_len,
                    max_num_seqs=max(args.batch_sizes),
                    speculative_config=system["config"],
                    speculation_profile_steps=0,
                    device=args.device,
                    num_kv_blocks=args.num_kv_blocks,
                    gpu_memory_utilization=gpu_share,
                    # async scheduling as on a GPU (it is off by default on a CPU, where nothing overlaps)
                    async_scheduling=True if args.stub_model else None,
                )
            )
        except Exception as e:  # noqa: BLE001 - record, say so, and go on with the next system
            report.doc.setdefault("errors", []).append({"system": label, "error": short_error(e)})
            report.save()
            log(f"error: system {label!r} not measured: {short_error(e)}")
            continue
        freeze_long_lived()  # as the Serve replica does (flexspec.engine.gc_heap)
        if engine.policy is not None:
            engine.policy.decide = lambda sched: Decision("plain", 0)
        engines[label] = engine
    attention_split.SPLIT_KV, fused.DECODE_FUSIONS, pdl.PDL = env_split_kv, env_fused_decode, env_pdl
    if not engines:
        report.save()
        raise SystemExit(1)
    any_engine = next(iter(engines.values()))
    prompts = prompt_token_ids(any_engine.tokenizer, "gsm8k", 16, 256)
    stub_text = _stub_text(any_engine.tokenizer) if args.stub_model else None
    stubs = [StubModel(e, stub_text) for e in engines.values()] if stub_text is not None else []
    labels = list(engines)
    max_tokens = (
        args.decode_first + args.repeats * args.steps + args.profile_steps + args.cprofile_steps + 200
    )
    for bs in args.batch_sizes:
        ids = {lb: fill(engines[lb], prompts, bs, max_tokens, args.decode_first) for lb in labels}
        rounds: dict[str, list[dict[str, float]]] = {lb: [] for lb in labels}
        for r in range(args.repeats):
            for lb in labels[r % len(labels) :] + labels[: r % len(labels)]:
                rounds[lb].append(time_steps(engines[lb], args.steps))
        base = None
        for lb in labels:
            med = {k: round(statistics.median(x[k] for x in rounds[lb]), 4) for k in rounds[lb][0]}
            point: dict[str, Any] = {
                "system": lb,
                "batch_size": bs,
                "steps": args.steps,
                "repeats": args.repeats,
                "output_tokens_at_start": args.decode_first + 10,
                **med,
                "wall_ms_rounds": [round(x["wall_ms_per_step"], 4) for x in rounds[lb]],
                **profile_steps(engines[lb], args.profile_steps, args.cprofile_steps),
            }
            if lb == labels[0] and lb in plain_labels:  # the plain engine (the first --split-kv value's)
                base = point["wall_ms_per_step"]
            elif base:
                point["vs_plain"] = round(point["wall_ms_per_step"] / base, 4)
            report.doc["points"].append(point)
            report.save()
            log(
                json.dumps(
                    {k: v for k, v in point.items() if k not in ("top_kernels", "host_top_us_per_step")}
                )
            )
        for lb in labels:
            for rid in ids[lb]:
                engines[lb].abort(rid)
            engines[lb].step()  # the aborted requests' state is freed with the next step
    for stub in stubs:
        stub.remove()
    report.save()
    if report.doc.get("errors"):
        raise SystemExit(1)  # a requested system was not measured (its error is logged and in the JSON)


def _stub_text(tokenizer: Any) -> list[int]:
    """Token ids of a real text for ``StubModel`` to emit: the GSM8K test questions shipped with flexspec."""
    from flexspec.datasets import load_prompts

    text = " ".join(p["prompt"] for p in load_prompts("gsm8k", limit=64))
    return tokenizer.encode(text, add_special_tokens=False)


if __name__ == "__main__":
    main()
