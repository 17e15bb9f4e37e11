"""Where the device idles during plain decoding steps: plain engine vs speculative engines held on plain.

Usage: python scripts/profile_gaps.py [BATCH_SIZE] [OUT_JSON] [SPEC_JSON ...]

For each system: fill the batch (greedy, EOS ignored), warm up, profile 30 ``LLMEngine.step()`` calls with
torch.profiler, then report the device's idle time per step (gaps between kernels inside the profiled
window) and, per host op (aten ops and CUDA runtime calls), how much of that idle time it overlapped: a gap
covered by ``cudaMemcpyAsync`` / ``cudaStreamSynchronize`` is a host-device sync, a gap covered by nothing
the profiler sees is Python.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from configs import EngineConfig, SamplingParams
from flexspec.engine.llm_engine import LLMEngine
from flexspec.spec.policy import Decision

STEPS = 30


def main() -> None:
    bs = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    out_path = sys.argv[2] if len(sys.argv) > 2 else None
    systems = [None, *(json.loads(a) for a in sys.argv[3:])]
    res = {"device": torch.cuda.get_device_name(0), "batch_size": bs, "points": []}
    for spec in systems:
        eng = LLMEngine(EngineConfig(model="smollm2-135m-instruct", max_model_len=1024, max_num_seqs=max(bs, 1),
                                     speculative_config=spec, speculation_profile_steps=0))  # fmt: skip
        if eng.policy is not None:
            eng.policy.decide = lambda sched: Decision("plain", 0)
        params = SamplingParams(max_tokens=600, temperature=0.0, ignore_eos=True)
        for i in range(bs):
            eng.add_request(list(range(100 + i, 160 + i)), params, request_id=f"r{i}")
        for _ in range(30):
            eng.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(STEPS):
                eng.step()
            torch.cuda.synchronize()
        evs = prof.events()
        kern = sorted(
            (e.time_range.start, e.time_range.end)
            for e in evs
            if e.device_type == torch.autograd.DeviceType.CUDA
        )
        gaps, end = [], None
        for s, e in kern:
            if end is not None and s > end:
                gaps.append((end, s))
            end = e if end is None else max(end, e)
        idle = sum(e - s for s, e in gaps)
        host = [e for e in evs if e.device_type == torch.autograd.DeviceType.CPU]
        by_op: dict[str, float] = defaultdict(float)
        for e in host:
            a, b = e.time_range.start, e.time_range.end
            for s, g in gaps:
                ov = min(b, g) - max(a, s)
                if ov > 0:
                    by_op[e.name] += ov
        top = sorted(by_op.items(), key=lambda kv: -kv[1])[:15]
        point = {
            "spec": spec,
            "idle_us_per_step": round(idle / STEPS, 1),
            "gaps_per_step": round(len(gaps) / STEPS, 1),
            "largest_gaps_us": sorted((round(g - s, 1) for s, g in gaps), reverse=True)[:8],
            "host_ops_over_idle_us_per_step": {k: round(v / STEPS, 1) for k, v in top},
        }
        res["points"].append(point)
        print(json.dumps(point))
        del eng
    if out_path:
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
