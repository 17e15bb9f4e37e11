"""GPU check (H200, bf16, CUDA graphs): DFlash plain steps launched by the runner (context K/V written from the
captured q=1 graph) give the same drafts/acceptance as plain steps run through the worker."""
import json, sys
from configs import EngineConfig, SamplingParams
from flexspec.datasets import load_prompts
from flexspec.engine.llm_engine import LLMEngine
from flexspec.spec.policy import Decision

def run(launch_plain, bs):
    eng = LLMEngine(EngineConfig(max_model_len=1024, max_num_seqs=bs, speculation_profile_steps=0,
        speculative_config={"method": "dflash", "model": "smollm2-135m-instruct-dflash"}))
    decide, n = eng.policy.decide, {"d": 0, "launched": 0}
    def two_plain_then_spec(sched):
        n["d"] += 1
        return Decision("plain", 0) if n["d"] % 3 else Decision("decoupled", eng.policy.spec.num_speculative_tokens)
    eng.policy.decide = two_plain_then_spec
    if launch_plain:
        launch = eng.executor.launch
        def counted(inp):
            n["launched"] += 1
            return launch(inp)
        eng.executor.launch = counted
    else:
        eng.executor.can_launch = lambda inp: False
    prompts = [eng.apply_chat_template([{"role": "user", "content": p["prompt"]}]) for p in load_prompts("gsm8k", 8)]
    outs = eng.generate(prompts, SamplingParams(max_tokens=96, temperature=0))
    m = eng.spec_metrics
    return {"tokens": [o.token_ids for o in outs], "drafts": m.num_draft_tokens, "accepted": m.num_accepted_tokens,
            "mal": 1 + m.num_accepted_tokens / max(m.num_drafts, 1), "launched": n["launched"]}

res = {}
for bs in (1, 8):
    a, b = run(True, bs), run(False, bs)
    res[f"b{bs}"] = {"launched": {k: v for k, v in a.items() if k != "tokens"}, "sync": {k: v for k, v in b.items() if k != "tokens"},
                     "same_tokens": a["tokens"] == b["tokens"],
                     "token_agreement": sum(x == y for ta, tb in zip(a["tokens"], b["tokens"]) for x, y in zip(ta, tb)) / sum(len(t) for t in a["tokens"])}
print(json.dumps(res, indent=1))
json.dump(res, open(sys.argv[1], "w"), indent=1)
