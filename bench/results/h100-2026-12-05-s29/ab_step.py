"""A/B on one engine: decoupled DFlash (k=15) steps with the fused tail graphs vs the eager device-side tail,
alternating blocks; ms per engine step, output tok/s, MAL at b=1 and b=4 (GSM8K prompts, 192 tokens)."""
import json, os, time, torch
from configs import EngineConfig, SamplingParams
from flexspec.engine.llm_engine import LLMEngine
from flexspec.datasets import load_prompts
from flexspec.spec.metrics import SpecDecodingMetrics
cfg = EngineConfig(model="smollm2-135m-instruct", dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=2048,
                   speculative_config={"method": "dflash", "model": "smollm2-135m-instruct-dflash",
                                       "execution": "decoupled", "num_speculative_tokens": 15})
t0 = time.perf_counter(); eng = LLMEngine(cfg); print(f"engine ready in {time.perf_counter()-t0:.1f} s", flush=True)
w = eng.executor.runner.spec_worker
tails = w.fused
print("fused query lengths:", sorted(tails), flush=True)
prompts = [eng.apply_chat_template([{"role": "user", "content": p["prompt"]}]) for p in load_prompts("gsm8k")[:8]]
sp = SamplingParams(temperature=0.0, max_tokens=192, ignore_eos=True)
eng.generate(prompts[:4], sp)
rows = []
for rep in range(3):
    for mode in ("fused", "eager"):
        w.fused = tails if mode == "fused" else {}
        for b in (1, 4):
            eng.spec_metrics = SpecDecodingMetrics()
            n0 = eng.stats.num_steps
            torch.cuda.synchronize(); t = time.perf_counter()
            outs = eng.generate(prompts[rep : rep + b], sp)
            torch.cuda.synchronize(); dt = time.perf_counter() - t
            steps = eng.stats.num_steps - n0
            ntok = sum(len(o.token_ids) for o in outs)
            r = {"rep": rep, "mode": mode, "batch": b, "ms_per_step": 1e3 * dt / steps, "tok_s": ntok / dt,
                 "mal": eng.spec_metrics.as_dict().get("mean_acceptance_length"), "steps": steps}
            rows.append(r); print(json.dumps(r), flush=True)
w.fused = tails
json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(os.environ.get("OUT", "/tmp") + "/ab_step.json", "w"), indent=1)
