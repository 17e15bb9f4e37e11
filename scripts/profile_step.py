"""Kernel breakdown of one decode step on the GPU (torch.profiler over CUDA-graph replays).

Usage: python scripts/profile_step.py MODEL [BATCH_SIZES] [OUT_JSON]. For each batch size it decodes a few
steps, then profiles ``--steps`` replays of the captured decode graph and reports per-kernel device time per
step (sum of kernel durations, launch gaps excluded), the kernel count per step and the wall time per step.
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from configs import EngineConfig, SamplingParams
from flexspec.engine.llm_engine import LLMEngine

STEPS = 20


def main() -> None:
    model = sys.argv[1]
    sizes = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "1,64").split(",")]
    out_path = sys.argv[3] if len(sys.argv) > 3 else None
    engine = LLMEngine(EngineConfig(model=model, max_model_len=1024))
    runner = engine.executor.runner
    res: dict = {"device": torch.cuda.get_device_name(0), "points": []}
    for bs in sizes:
        for i in range(bs):
            engine.add_request(
                list(range(10, 40)),
                request_id=f"p{bs}-{i}",
                params=SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True),
            )
        for _ in range(4):  # prefill + a few decode steps
            engine.step()
        graphs = runner.graphs[0]
        gbs = next(b for b in graphs.batch_sizes if b >= bs)
        g = graphs.graphs[gbs]
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(100):
            g.replay()
        torch.cuda.synchronize()
        replay_ms = (time.perf_counter() - t0) * 10
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(STEPS):
                g.replay()
            torch.cuda.synchronize()
        per = defaultdict(lambda: [0, 0.0])
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                per[ev.name][0] += 1
                per[ev.name][1] += ev.device_time_total
        total_us = sum(v[1] for v in per.values()) / STEPS
        count = sum(v[0] for v in per.values()) / STEPS
        top = sorted(per.items(), key=lambda kv: -kv[1][1])[:15]
        point = {
            "batch_size": bs,
            "graph_batch_size": gbs,
            "graph_replay_ms": round(replay_ms, 4),
            "kernel_time_ms_per_step": round(total_us / 1000, 4),
            "kernels_per_step": count,
            "top_kernels": [
                {"name": n[:90], "per_step": c / STEPS, "us_per_step": round(t / STEPS, 2)}
                for n, (c, t) in top
            ],
        }
        res["points"].append(point)
        print(json.dumps(point, indent=1))
        if out_path:
            with open(out_path, "w") as f:
                json.dump(res, f, indent=1)
        for i in range(bs):
            engine.abort(f"p{bs}-{i}")
        while engine.has_unfinished:
            engine.step()


if __name__ == "__main__":
    main()
