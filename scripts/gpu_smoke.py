"""GPU smoke + timing (run on the H200): CUDA-graph decode == eager; FlexDraft parallel / decoupled exact in
bf16; drafter CUDA graphs (FlexDraft decoupled, DFlash) == their eager step; decode step time. Writes JSON to argv[2] (default: stdout). Usage: python scripts/gpu_smoke.py MODEL [OUT]"""

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
    prompts = [
        eager.apply_chat_template([{"role": "user", "content": p["prompt"]}])
        for p in load_prompts("gsm8k", 8)
    ]
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
    res["drafter_graphs"] = {m: drafter_graph_check(model, m) for m in ("flexdraft", "dflash")}
    out = json.dumps(res, indent=1)
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            f.write(out)
    print(out)


@torch.inference_mode()
def drafter_graph_check(model: str, method: str, bs: int = 8) -> dict:
    """Replay the shipped drafter's captured step and run it eagerly on the same random inputs (a captured
    batch size, so both run the same kernels): the drafts must be identical."""
    sc = {"method": method, "model": f"smollm2-135m-instruct-{method}", "num_speculative_tokens": 15}
    if method == "flexdraft":
        sc["execution"] = "decoupled"
    e = LLMEngine(EngineConfig(model=model, max_model_len=1024, speculative_config=sc))
    runner = e.executor.runner
    drafter = runner.spec_worker.drafter
    if drafter._graphs is None:
        return {"captured": False}
    g = torch.Generator().manual_seed(0)
    width = runner.max_blocks_per_seq
    tables = torch.randint(0, runner.num_kv_blocks, (bs, width), generator=g, dtype=torch.int32).cuda()
    pos = torch.randint(0, 900, (bs,), generator=g).cuda()
    bonus = torch.randint(0, runner.spec.vocab_size, (bs,), generator=g).cuda()
    if method == "flexdraft":
        eager = drafter._decoupled_step(pos, tables, bonus)
        graph = drafter._graphs.run(bs, last_pos=pos, tables=tables, bonus=bonus)
    else:
        ctx = pos.to(torch.int32)
        eager = drafter._greedy_block(bonus, ctx, tables)
        graph = drafter._graphs.run(bs, bonus=bonus, ctx_lens=ctx, tables=tables)
    same = all(torch.equal(a, b) for a, b in zip(eager, graph))
    return {"captured": True, "batch_sizes": drafter._graphs.batch_sizes, "identical": same}


if __name__ == "__main__":
    main()
