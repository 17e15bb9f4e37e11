"""Session-22 diagnostic: async vs synchronous scheduling on the GPU (bf16 and fp32): which request diverges
where, and the launched steps' token counts in each mode."""
import sys
from configs import EngineConfig, SamplingParams
from flexspec.engine.llm_engine import LLMEngine
from tests.conftest import DEFAULT_MODEL
from tests.engine.test_async_output import chat, run_streaming
from tests.engine.test_async_scheduling import count_launches
import contextlib

for dtype in sys.argv[1:]:
    eng = LLMEngine(EngineConfig(model=DEFAULT_MODEL, max_model_len=1024, device="cuda", max_num_seqs=8, dtype=dtype))
    texts = ["Write a short poem about the sea.", "What is 12 times 7?", "List three colours.", "Say hello.",
             "Tell me about dragons.", "Name a car.", "Count to ten.", "Explain gravity briefly."]
    prompts = [chat(eng, t) for t in texts]
    params = [SamplingParams(max_tokens=24 + 9 * i, temperature=0, stop=["\n\n"] if i == 2 else None) for i in range(8)]
    params[5] = SamplingParams(max_tokens=40, temperature=0.8, seed=11)
    runs = {}
    for mode in (True, False, True, False):
        eng.config.async_scheduling = mode
        with contextlib.ExitStack() as st:
            launched = st.enter_context(count_launches(eng))
            out = run_streaming(eng, prompts, params)
        runs.setdefault(mode, []).append((out, [n for n, _ in launched]))
    for mode, rs in runs.items():
        same = [a[1] == b[1] for a, b in zip(rs[0][0], rs[1][0])]
        print(dtype, "async" if mode else "sync", "repeatable per request:", same, "steps", rs[0][1][:40])
    for i, (a, b) in enumerate(zip(runs[True][0][0], runs[False][0][0])):
        if a[1] != b[1]:
            k = next(j for j, (x, y) in enumerate(zip(a[1], b[1])) if x != y) if any(x != y for x, y in zip(a[1], b[1])) else min(len(a[1]), len(b[1]))
            print(dtype, f"request {i} diverges at {k}: async {a[1][k-2:k+3]} sync {b[1][k-2:k+3]}; lens {len(a[1])} {len(b[1])}")
    print(dtype, "all equal:", all(a[1] == b[1] for a, b in zip(runs[True][0][0], runs[False][0][0])))
