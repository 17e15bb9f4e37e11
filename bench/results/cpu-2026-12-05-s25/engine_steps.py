import time, torch, sys
from configs import EngineConfig, SamplingParams
from flexspec.engine.llm_engine import LLMEngine
import flexspec.layers.linear as L
from tests.conftest import real_prompts
eng = LLMEngine(EngineConfig(model="smollm2-135m-instruct", max_model_len=1024, device="cpu"))
prompts = real_prompts(eng, 7)
res = {}
for mode in sys.argv[1].split(","):
    L.CPU_GEMM = mode
    eng.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4))
    for b in (1, 8, 21):
        sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        t = time.perf_counter(); outs = eng.generate(prompts[:b], sp); dt = time.perf_counter() - t
        res[(mode, b)] = [o.token_ids for o in outs]
        print(f"{mode} b={b}: {dt:.2f}s -> {dt/32*1000:.0f} ms/step (incl prefill)", flush=True)
modes = sys.argv[1].split(",")
for b in (1, 8, 21):
    print(b, "same tokens across modes:", all(res[(m, b)] == res[(modes[0], b)] for m in modes))
