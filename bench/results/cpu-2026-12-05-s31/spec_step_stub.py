"""Engine-side host work of speculative (decoupled DFlash) steps with an instant executor stub, session 31.

    PYTHONPATH=TREE python spec_step_stub.py BATCH ROUNDS OUT.json

The executor is replaced by a stub that, for every emitting sequence, accepts a random number of its drafts
(seeded) and proposes 15 new ones; the engine's own work per step is timed: scheduling, the policy, input building,
output processing (token appends, stop checks) and detokenization / outputs (``_emit``). The worker's CUDA-graph
staging is not in it (``bench.host_staging``). A CPU regression number; run with ``PYTHONPATH`` set to the tree
to measure (the script's folder comes first on ``sys.path`` otherwise, so set it explicitly).
"""

import collections
import json
import random
import sys
import time

import flexspec
from configs import EngineConfig, SamplingParams
from flexspec.engine.llm_engine import LLMEngine
from flexspec.engine.model_input import ModelOutput

batch, rounds, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
eng = LLMEngine(
    EngineConfig(
        model="smollm2-135m-instruct",
        max_model_len=4096,
        max_num_seqs=batch,
        device="cpu",
        num_kv_blocks=20000,
        speculation_profile_steps=0,
        speculative_config={
            "method": "dflash",
            "model": "smollm2-135m-instruct-dflash",
            "execution": "decoupled",
        },
    )
)
rng = random.Random(0)
words = eng.tokenizer.encode(" the cat sat on a mat and then 12 more went home to eat")  # ordinary text tokens


def fake(inp):
    tokens, drafts = [], []
    for d, emits in zip(inp.num_draft_tokens, inp.samples):
        if emits:
            tokens.append([rng.choice(words) for _ in range(rng.randint(0, d) + 1)])
            drafts.append([rng.choice(words) for _ in range(inp.num_speculative_tokens)])
    return ModelOutput(token_ids=tokens, draft_token_ids=drafts)


ex = eng.executor
ex.can_launch = lambda inp: True
ex.launch = fake
ex.collect = lambda out: out
ex.execute = fake
params = SamplingParams(max_tokens=3800, temperature=0.0, ignore_eos=True)
for i in range(batch):
    eng.add_request([1, 2, 3, 4 + i] * 40, params=params, request_id=f"r{i}")
for _ in range(20):
    eng.step()
parts: dict[str, float] = collections.defaultdict(float)


def timed(obj, name):
    f = getattr(obj, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            parts[name] += time.perf_counter() - t

    setattr(obj, name, wrapper)


for obj, name in ((eng, "build_model_input"), (eng.scheduler, "schedule"), (eng, "_append_ids"), (eng, "_emit"),
                  (ex, "launch")):  # fmt: skip
    timed(obj, name)
walls = []
steps = 40
for _ in range(rounds):
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    walls.append((time.perf_counter() - t) / steps * 1e3)
n = rounds * steps
doc = {
    "tree": flexspec.__file__,
    "batch_size": batch,
    "mode": eng.last_mode,
    "wall_ms_per_step_rounds": [round(w, 4) for w in walls],
    "wall_ms_per_step_median": round(sorted(walls)[len(walls) // 2], 4),
    "ms_per_step": {k: round(v / n * 1e3, 4) for k, v in parts.items()},  # launch = the stub (not engine work)
}
print(json.dumps(doc))
with open(out_path, "w") as f:
    json.dump(doc, f, indent=1)
