"""Host work per step at batch 64 on the GPU (session 44): decoupled DFlash k=7 vs plain; wall, executor time
(launch + collect) and the rest (host), then cProfile of as many steps. Run on the device after
`scripts/device_stage.sh unpack` with PYTHONPATH=/tmp/site:. (see README there)."""

import cProfile
import gc
import io
import pstats
import time

import torch

from bench.common import prompt_token_ids
from configs import EngineConfig, SamplingParams
from flexspec.engine.gc_heap import freeze_long_lived
from flexspec.engine.llm_engine import LLMEngine

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DT = "bfloat16" if DEV == "cuda" else "float32"
SYNC = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)


def run(k, B, steps, mode):
    spec = (
        None
        if mode == "plain"
        else {
            "method": "dflash",
            "model": "smollm2-135m-instruct-dflash",
            "num_speculative_tokens": k,
            "execution": mode,
        }
    )
    eng = LLMEngine(
        EngineConfig(
            model="smollm2-135m-instruct",
            max_model_len=1024,
            device=DEV,
            dtype=DT,
            gpu_memory_utilization=0.3,
            speculative_config=spec,
            max_num_seqs=B,
        )
    )
    freeze_long_lived()
    ex = eng.executor
    ex_time = [0.0]
    for name in ("execute", "launch", "collect"):
        fn = getattr(ex, name, None)
        if fn is None:
            continue

        def wrap(*a, _fn=fn, **kw):
            t = time.perf_counter()
            out = _fn(*a, **kw)
            ex_time[0] += time.perf_counter() - t
            return out

        setattr(ex, name, wrap)
    prompts = prompt_token_ids(eng.tokenizer, "gsm8k", B, max_prompt_len=128)
    params = SamplingParams(max_tokens=700, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(p, params, request_id=f"r{i}")
    for _ in range(40):
        eng.step()
    SYNC()
    ex_time[0] = 0.0
    t0 = time.perf_counter()
    toks0 = eng.stats.num_generation_tokens
    for _ in range(steps):
        eng.step()
    SYNC()
    wall = time.perf_counter() - t0
    ntok = eng.stats.num_generation_tokens - toks0
    print(
        f"== {mode} k={k} B={B}: wall/step {wall / steps * 1e3:.3f} ms, executor/step {ex_time[0] / steps * 1e3:.3f}, host/step {(wall - ex_time[0]) / steps * 1e3:.3f}, tokens/step/seq {ntok / steps / B:.2f}",
        flush=True,
    )
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        eng.step()
    prof.disable()
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumtime").print_stats("flexspec|bench", 45)
    print(s.getvalue()[:14000], flush=True)
    eng.shutdown()
    del eng
    gc.collect()
    (torch.cuda.empty_cache() if DEV == "cuda" else None)


B, N = (64, 150) if DEV == "cuda" else (4, 3)
run(7, B, N, "decoupled")
run(0, B, N, "plain")
