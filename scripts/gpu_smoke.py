"""GPU smoke + timing (run on the H200): CUDA-graph decode == eager; FlexDraft parallel / decoupled exact in
bf16; decode step time. Writes JSON to argv[2] (default: stdout). Usage: python scripts/gpu_smoke.py MODEL [OUT]"""

from __future__ import annotations

import json
import sys
import tempfile
import time

import torch

from configs import EngineConfig, SamplingParams
from flexspec.datasets import load_prompts
from flexspec.engine.llm_engine import LLMEngine
from flexspec.spec.models.flexdraft_model import FlexDraftModel


def main() -> None:
    model = sys.argv[1]
    res: dict = {"device": torch.cuda.get_device_name(0)}
    eager = LLMEngine(EngineConfig(model=model, enforce_eager=True, max_model_len=1024))
    graph = LLMEngine(EngineConfig(model=model, max_model_len=1024))
    prompts = [eager.apply_chat_template([{"role": "user", "content": p["prompt"]}]) for p in load_prompts("gsm8k", 8)]
    p = SamplingParams(max_tokens=64, temperature=0)
    a = [o.token_ids for o in eager.generate(prompts, p)]
    b = [o.token_ids for o in graph.generate(prompts, p)]
    res["graph_equals_eager"] = a == b
    res["graph_equals_eager_frac"] = sum(x == y for x, y in zip(a, b)) / len(a)
    for bs in (1, 8, 32):
        ps = (prompts * 8)[:bs]
        q = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
        graph.generate(ps, SamplingParams(max_tokens=8, temperature=0))
        torch.cuda.synchronize()
        t = time.perf_counter()
        graph.generate(ps, q)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        res[f"plain_tok_s_bs{bs}"] = round(bs * 128 / dt, 1)
    with tempfile.TemporaryDirectory() as d:
        fd = FlexDraftModel.init_for_target(graph.executor.runner.model, 25, 16, 256)
        fd.float().save_pretrained(d, dtype=torch.bfloat16)
        for mode in ("parallel", "decoupled"):
            sc = {"method": "flexdraft", "model": d, "num_speculative_tokens": 15, "execution": mode}
            e = LLMEngine(EngineConfig(model=model, max_model_len=1024, speculative_config=sc))
            outs = [o.token_ids for o in e.generate(prompts, p)]
            res[f"flexdraft_{mode}_exact_frac"] = sum(x == y for x, y in zip(outs, b)) / len(b)
            res[f"flexdraft_{mode}_metrics"] = e.spec_metrics.as_dict()
    out = json.dumps(res, indent=1)
    if len(sys.argv) > 2:
        open(sys.argv[2], "w").write(out)
    print(out)


if __name__ == "__main__":
    main()
