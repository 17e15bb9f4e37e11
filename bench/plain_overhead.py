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

from bench.common import JsonReport, environment, int_list, log, prompt_token_ids, short_error
from bench.spec_bench import expand_configs


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


def measure(
    engine: Any,
    prompts: list[list[int]],
    batch_size: int,
    steps: int,
    profile_steps: int,
    cprofile_steps: int = 0,
) -> dict:
    """Fill the batch, prefill + warm up, time ``steps`` steps, profile ``profile_steps`` more (torch.profiler)
    and ``cprofile_steps`` more (cProfile: host functions)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from configs import SamplingParams

    params = SamplingParams(max_tokens=steps + profile_steps + 200, temperature=0.0, ignore_eos=True)
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
    for _ in range(10):
        engine.step()
    _sync()
    gaps = _HostGaps(engine)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync()
    wall_ms = (time.perf_counter() - t0) / steps * 1e3
    gaps.remove()
    point: dict[str, Any] = {
        "batch_size": batch_size,
        "steps": steps,
        "wall_ms_per_step": round(wall_ms, 4),
        **gaps.summary(),
    }
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
    if cprofile_steps:  # the host functions with the most own time (cProfile slows the host: separate steps)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(cprofile_steps):
            engine.step()
        prof.disable()
        rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:20]  # type: ignore[attr-defined]
        point["host_top_us_per_step"] = {
            f"{Path(f).name}:{line}({fn})": round(1e6 * tt / cprofile_steps, 1)
            for (f, line, fn), (_, _, tt, _, _) in rows
        }
    for rid in ids:
        engine.abort(rid)
    engine.step()  # the aborted requests' state is freed with the next step
    return point


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch-sizes", type=int_list, default=[1, 8, 64])
    ap.add_argument("--steps", type=int, default=300, help="Timed steps per point.")
    ap.add_argument("--profile-steps", type=int, default=20, help="Profiled steps per point (0 = none).")
    ap.add_argument("--cprofile-steps", type=int, default=0, help="Steps under cProfile per point (0 = none).")
    ap.add_argument(
        "--speculative-config", action="append", default=[], help="JSON dict or list (repeatable)."
    )
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)

    from configs import EngineConfig
    from flexspec.engine.llm_engine import LLMEngine
    from flexspec.spec.policy import Decision

    systems = [{"label": "plain", "config": None}, *expand_configs(args.speculative_config, None)]
    report = JsonReport(
        args.output,
        {
            "schema": "flexspec.bench.plain_overhead/1",
            "env": environment(),
            "config": vars(args),
            "points": [],
        },
    )
    base: dict[int, float] = {}
    for system in systems:
        label = system["label"]
        try:
            engine = LLMEngine(
                EngineConfig(
                    model=args.model,
                    max_model_len=args.max_model_len,
                    max_num_seqs=max(args.batch_sizes),
                    speculative_config=system["config"],
                    speculation_profile_steps=0,
                )
            )
        except Exception as e:  # noqa: BLE001 - record and go on with the next system
            report.doc.setdefault("errors", []).append({"system": label, "error": short_error(e)})
            report.save()
            continue
        if engine.policy is not None:
            engine.policy.decide = lambda sched: Decision("plain", 0)
        prompts = prompt_token_ids(engine.tokenizer, "gsm8k", 16, 256)
        for bs in args.batch_sizes:
            point = {
                "system": label,
                **measure(engine, prompts, bs, args.steps, args.profile_steps, args.cprofile_steps),
            }
            if label == "plain":
                base[bs] = point["wall_ms_per_step"]
            elif bs in base:
                point["vs_plain"] = round(point["wall_ms_per_step"] / base[bs], 4)
            report.doc["points"].append(point)
            report.save()
            log(json.dumps({k: v for k, v in point.items() if k != "top_kernels"}))
        del engine
    report.save()


if __name__ == "__main__":
    main()
