"""H200: the skinny decoder GEMMs (tune_skinny's per-layer timing, us) with the dot form preloading its weights
under PDL vs not, at 1-16 rows; then what the engine picks."""
import json, os, torch
import flexspec_kernels.skinny_linear as SL
from configs import EngineConfig
from flexspec.engine.llm_engine import LLMEngine
eng = LLMEngine(EngineConfig(model="smollm2-135m-instruct", dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=2048))
model = eng.executor.runner.model
res = {}
for rnd in range(2):
    for pre in (False, True):
        SL.DOT_PRELOAD = pre
        rows = model.tune_skinny()
        res[f"preload={pre} round={rnd}"] = {"skinny_max_rows": rows, "timing_us": model.skinny_timing}
        print(f"preload={pre} round {rnd}: max_rows {rows}", {r: (round(t['unfused_us'], 2), round(t['fused_us'], 2)) for r, t in model.skinny_timing.items()}, flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "tune_preload.json"), "w"), indent=1)
