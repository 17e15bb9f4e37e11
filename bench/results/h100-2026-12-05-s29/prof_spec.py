"""H200: where a b=1 decoupled DFlash step's 1.5 ms go (vs a 0.45 ms plain step): wall per step, CUDA time
per step, top CPU / CUDA ops, host gaps."""
import json, os, sys, time, torch
from configs import EngineConfig, SamplingParams
from flexspec.engine.llm_engine import LLMEngine
from flexspec.datasets import load_prompts
out = os.environ.get("OUT", "/tmp")
k = int(sys.argv[1]) if len(sys.argv) > 1 else 15
cfg = EngineConfig(model="smollm2-135m-instruct", dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=2048,
                   speculative_config={"method": "dflash", "model": "smollm2-135m-instruct-dflash",
                                       "execution": "decoupled", "num_speculative_tokens": k})
eng = LLMEngine(cfg)
prompts = [eng.apply_chat_template([{"role": "user", "content": p["prompt"]}]) for p in load_prompts("gsm8k")[:4]]
sp = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
eng.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=64))
rid = eng.add_request(prompts[1], sp)
for _ in range(5): eng.step()
torch.cuda.synchronize()
n = 30
t = time.perf_counter()
for _ in range(n): eng.step()
torch.cuda.synchronize(); dt = (time.perf_counter() - t) / n
print(f"k={k} wall per spec step {dt*1000:.3f} ms, MAL so far {eng.spec_metrics.as_dict().get('mean_acceptance_length')}")
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(20):
        with torch.profiler.record_function('engine_step'): eng.step()
    torch.cuda.synchronize()
ka = prof.key_averages()
print(ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
print(ka.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))
prof.export_chrome_trace(f"{out}/spec_trace_k{k}.json")
