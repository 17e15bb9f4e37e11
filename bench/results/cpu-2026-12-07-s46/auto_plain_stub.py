"""Host work per step with an instant model (``bench.plain_overhead.StubModel``): the plain engine against a
DFlash ``auto`` engine whose policy decides for real, its step-time table seeded so that plain decoding always
wins (speculative options 500x slower, no probes), with request turnover (prompts join the running batch).

    OMP_NUM_THREADS=1 PYTHONPATH=<repo> python auto_plain_stub.py BATCH NUM_REQUESTS [CPROFILE_PREFIX|-] [ROUNDS]
"""

import cProfile
import random
import statistics
import sys
import time

from bench.common import prompt_token_ids
from bench.plain_overhead import StubModel, _stub_text
from configs import EngineConfig, SamplingParams
from flexspec.engine.llm_engine import LLMEngine
from flexspec.spec import policy_tuning as tuning

B, N = int(sys.argv[1]), int(sys.argv[2])
PROFILE = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] != "-" else None
ROUNDS = int(sys.argv[4]) if len(sys.argv) > 4 else 3
tuning.REEXPLORE_EVERY = tuning.REEXPLORE_MAX = 10**9  # no probes: the stub cannot run speculative steps


def make(spec):
    e = LLMEngine(
        EngineConfig(
            model="smollm2-135m-instruct", max_model_len=1024, max_num_seqs=B, speculative_config=spec,
            speculation_profile_steps=0, device="cpu", num_kv_blocks=20000, async_scheduling=True,
        )
    )  # fmt: skip
    p = e.policy
    if p is not None:  # a profile as if measured: plain 1 ms per step, every speculative option 500 ms
        b = 1
        while b <= B:
            for m in p.options:
                for _ in range(tuning.WARMUP_SAMPLES + 1):
                    p.profile.setdefault((m, b), []).append(0.001 if m == "plain" else 0.5)
                    for kind in ("enter", "exit") if m != "plain" else ():
                        p.profile.setdefault((f"{kind}:{m}", b), []).append(0.5)
            b *= 2
        p.finish_profile()
        p._warmed = True

        def launch(inp):
            raise SystemExit(f"the policy chose {inp.spec_mode}: the stub runs plain steps only")

        e.executor.runner.spec_worker.launch = launch
    return e


engines = {"plain": make(None), "auto": make({"method": "dflash", "model": "smollm2-135m-instruct-dflash"})}
stubs = [StubModel(e, _stub_text(e.tokenizer)) for e in engines.values()]
prompts = prompt_token_ids(engines["plain"].tokenizer, "gsm8k", 64, 256)


def run(e, seed: int) -> tuple[float, int]:
    rng = random.Random(seed)
    for i in range(N):
        e.add_request(prompts[i % len(prompts)], SamplingParams(max_tokens=rng.randint(48, 200), temperature=0,
                                                                 ignore_eos=True))  # fmt: skip
    steps, t = 0, time.perf_counter()
    while e.has_unfinished:
        e.step()
        steps += 1
    return (time.perf_counter() - t) * 1e3 / steps, steps


res: dict[str, list[tuple[float, int]]] = {k: [] for k in engines}
for r in range(ROUNDS):
    for k in list(engines)[:: 1 if r % 2 == 0 else -1]:
        res[k].append(run(engines[k], r))
for k, v in res.items():
    print(k, "ms/step", [round(x[0], 4) for x in v], "steps", [x[1] for x in v],
          "median", round(statistics.median(x[0] for x in v), 4))  # fmt: skip
p = engines["auto"].policy
print("auto modes", p.mode_counts, "rankings", p.num_rankings, "decisions", p.num_decisions)
if PROFILE:
    for k, e in engines.items():
        pr = cProfile.Profile()
        pr.enable()
        run(e, 99)
        pr.disable()
        pr.dump_stats(f"{PROFILE}.{k}")
