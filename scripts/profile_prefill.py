"""Where a prefill (or mixed prefill + decode) step's time goes: wall time, device time, kernel count, and the
host functions with the most own time (cProfile), for the plain engine.

Usage: python scripts/profile_prefill.py [OUT_JSON] [--new-requests 1,8] [--decoding 0,56] [--mixed-graphs on,off]

Each point: ``decoding`` requests are decoding (EOS ignored) when ``new_requests`` new ones arrive; the step
that prefills them is timed (median of 5, with a device sync), then profiled once with torch.profiler (device
time, kernel count) and once with cProfile. ``--mixed-graphs on,off`` profiles an engine whose prefill steps
replay mixed-step CUDA graphs (``cuda_graph_num_tokens``, the default) and one that runs them eagerly.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from configs import EngineConfig, SamplingParams
from flexspec.engine.llm_engine import LLMEngine

PROMPT = "Question: a train travels 60 km in 45 minutes. How far does it go in 2 hours? Explain step by step."


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("--new-requests", default="1,8")
    ap.add_argument("--decoding", default="0,56")
    ap.add_argument("--mixed-graphs", default="on,off")
    args = ap.parse_args()
    res: dict = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "points": [],
    }
    for setting in args.mixed_graphs.split(","):
        extra = {} if setting == "on" else {"cuda_graph_num_tokens": []}
        cfg = EngineConfig(model="smollm2-135m-instruct", max_model_len=1024, max_num_seqs=64, **extra)
        eng = LLMEngine(cfg)
        runner = getattr(eng.executor, "runner", None)
        captured = runner is not None and runner.mixed_graphs is not None
        print(f"mixed graphs {setting}: captured={captured}")
        _profile(eng, args, res, {"mixed_graphs": setting, "mixed_graphs_captured": captured})
        del eng
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


def _profile(eng: LLMEngine, args, res: dict, tags: dict) -> None:
    prompt = eng.apply_chat_template([{"role": "user", "content": PROMPT}])
    long_run = SamplingParams(max_tokens=800, temperature=0.0, ignore_eos=True)
    rid = 0
    for decoding in (int(x) for x in args.decoding.split(",")):
        for new in (int(x) for x in args.new_requests.split(",")):
            for r in list(eng.scheduler.running) + list(eng.scheduler.waiting):
                eng.abort(r.request_id)
            while eng.has_unfinished:
                eng.step()
            for _ in range(decoding):
                eng.add_request(prompt, long_run, request_id=f"d{rid}")
                rid += 1
            for _ in range(3):
                eng.step()

            def one_prefill(new: int = new) -> float:
                nonlocal rid
                for _ in range(new):
                    eng.add_request(
                        prompt, SamplingParams(max_tokens=4, temperature=0.0), request_id=f"n{rid}"
                    )
                    rid += 1
                _sync()
                t0 = time.perf_counter()
                eng.step()  # async output processing: this call schedules and launches the prefill
                eng.step()  # ... and this one collects it
                _sync()
                return time.perf_counter() - t0

            times = [one_prefill() for _ in range(5)]
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                one_prefill()
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            dev_ms = sum(getattr(e, "device_time_total", 0) for e in kernels) / 1000
            pr = cProfile.Profile()
            pr.enable()
            one_prefill()
            pr.disable()
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(18)
            point = {
                **tags,
                "decoding": decoding,
                "new_requests": new,
                "prompt_tokens": len(prompt),
                "two_steps_ms_median": round(statistics.median(times) * 1000, 3),
                "device_ms": round(dev_ms, 3),
                "kernels": len(kernels),
                "cprofile": buf.getvalue().splitlines()[:45],
            }
            res["points"].append(point)
            print(json.dumps({k: v for k, v in point.items() if k != "cprofile"}))
            print("\n".join(point["cprofile"][6:32]))


if __name__ == "__main__":
    main()
