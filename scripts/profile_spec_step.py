"""Where a speculative decoding step's time goes on the GPU (torch.profiler over real engine steps).

Usage: python scripts/profile_spec_step.py SPEC_JSON [BATCH_SIZES] [OUT_JSON] [TRACE_DIR]

Fills the batch with greedy requests (EOS ignored), warms up, then profiles ``STEPS`` ``LLMEngine.step()``
calls of the forced speculative mode and reports per step: wall time, device time (sum of kernel durations),
the kernel count, the device time of each CUDA graph's kernels vs eager kernels, and the kernels with the most
device time; host time per Python-level region (record_function ranges of the worker). ``TRACE_DIR`` also gets a
Chrome trace of the first batch size.
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

STEPS = 30


def sync_device() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


HOST_OPS = (
    "cudaGraphLaunch",
    "cudaMemcpyAsync",
    "cudaStreamSynchronize",
    "cudaEventSynchronize",
    "cudaLaunchKernel",
    "aten::copy_",
    "aten::to",
    "aten::item",
    "aten::_local_scalar_dense",
)
PROMPT = "Question: a train travels 60 km in 45 minutes. How far does it go in 2 hours? Explain step by step."


def filled_engine(spec: dict | None, bs: int, max_model_len: int = 1024, warmup_steps: int = 20) -> LLMEngine:
    """An engine (``spec`` or plain, no warm-up profile) running ``bs`` greedy requests of ``PROMPT`` that ignore
    EOS (room for ``max_model_len`` tokens), after ``warmup_steps`` steps; the device is idle on return."""
    eng = LLMEngine(EngineConfig(model="smollm2-135m-instruct", max_model_len=max_model_len, max_num_seqs=bs,
                                 speculative_config=spec, speculation_profile_steps=0))  # fmt: skip
    params = SamplingParams(max_tokens=max_model_len - 124, temperature=0.0, ignore_eos=True)
    prompt = eng.apply_chat_template([{"role": "user", "content": PROMPT}])
    for i in range(bs):
        eng.add_request(prompt, params, request_id=f"r{i}")
    for _ in range(warmup_steps):
        eng.step()
    sync_device()
    return eng


def main() -> None:
    spec = json.loads(sys.argv[1])
    sizes = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "1,8").split(",")]
    out_path = sys.argv[3] if len(sys.argv) > 3 else None
    trace_dir = sys.argv[4] if len(sys.argv) > 4 else None
    res: dict = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "spec": spec,
        "points": [],
    }
    for bs in sizes:
        eng = filled_engine(spec, bs)
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(STEPS):
                eng.step()
            sync_device()
        wall = (time.perf_counter() - t0) / STEPS
        kernels: dict[str, list[float]] = defaultdict(list)
        host: dict[str, float] = defaultdict(float)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kernels[e.name].append(
                    e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time
                )
            elif e.name in HOST_OPS:
                host[e.name] += e.cpu_time_total
        total = sum(sum(v) for v in kernels.values()) / STEPS / 1000
        count = sum(len(v) for v in kernels.values()) / STEPS
        top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:25]
        point = {
            "batch_size": bs,
            "wall_ms_per_step": round(wall * 1000, 3),
            "kernel_ms_per_step": round(total, 3),
            "kernels_per_step": round(count, 1),
            "mal": eng.spec_metrics.as_dict().get("mean_acceptance_length"),
            "top_kernels": [
                {
                    "name": n[:90],
                    "ms_per_step": round(sum(v) / STEPS / 1000, 4),
                    "calls_per_step": len(v) / STEPS,
                }
                for n, v in top
            ],
            "host_regions_ms_per_step": {k: round(v / STEPS / 1000, 3) for k, v in sorted(host.items())},
        }
        res["points"].append(point)
        print(json.dumps({k: v for k, v in point.items() if k != "top_kernels"}))
        for k in point["top_kernels"][:12]:
            print("   ", k)
        if trace_dir and bs == sizes[0]:
            import gzip
            import shutil

            prof.export_chrome_trace(f"/tmp/trace_b{bs}.json")
            with (
                open(f"/tmp/trace_b{bs}.json", "rb") as src,
                gzip.open(f"{trace_dir}/trace_b{bs}.json.gz", "wb") as dst,
            ):
                shutil.copyfileobj(src, dst)
        del eng
    if out_path:
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
