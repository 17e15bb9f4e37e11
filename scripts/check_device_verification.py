"""GPU check of device-side verification steps: the same engine (CUDA graphs, bf16) with
``device_verification`` on and off generates the same GSM8K prompts at T=0; reports how many outputs and how
many steps' (emitted tokens, next drafts) agree, and the spec-decode metrics of both. In fp32 on CPU the two
paths agree exactly (tests/spec/test_device_verification.py); in bf16 the drafter's context step runs at
another padded row count in each path, which may round differently and change a draft now and then.

Usage: python scripts/check_device_verification.py OUT.json [--num-prompts 16] [--batch-sizes 1,8]
"""

from __future__ import annotations

import argparse
import json

import torch

from configs import EngineConfig, SamplingParams
from flexspec.datasets import load_prompts
from flexspec.engine.llm_engine import LLMEngine
from flexspec.spec.metrics import SpecDecodingMetrics

SPECS = {
    "dflash": {"method": "dflash", "model": "smollm2-135m-instruct-dflash", "execution": "decoupled"},
    "flexdraft": {
        "method": "flexdraft",
        "model": "smollm2-135m-instruct-flexdraft",
        "execution": "decoupled",
    },
}


def run(eng: LLMEngine, prompts: list[list[int]], device_verification: bool) -> dict:
    worker = eng.executor.runner.spec_worker
    worker.device_verification = device_verification
    steps: list = []
    execute, collect = worker.execute, worker.collect

    def executed(inp):
        out = execute(inp)
        if out is not None:
            steps.append((out.token_ids, out.draft_token_ids))
        return out

    def collected(pending):
        out = collect(pending)
        steps.append((out.token_ids, out.draft_token_ids))
        return out

    worker.execute, worker.collect = executed, collected
    eng.spec_metrics = SpecDecodingMetrics()
    try:
        outs = [o.token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=128, temperature=0))]
    finally:
        del worker.execute, worker.collect
    return {"outputs": outs, "steps": steps, "metrics": eng.spec_metrics.as_dict()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--batch-sizes", default="1,8")
    args = ap.parse_args()
    res: dict = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    for name, spec in SPECS.items():
        for bs in (int(b) for b in args.batch_sizes.split(",")):
            eng = LLMEngine(EngineConfig(model="smollm2-135m-instruct", max_model_len=1024, max_num_seqs=bs,
                                         speculative_config=spec))  # fmt: skip
            prompts = [eng.apply_chat_template([{"role": "user", "content": p["prompt"]}])
                       for p in load_prompts("gsm8k", args.num_prompts)]  # fmt: skip
            run(eng, prompts[:2], True)  # warm-up
            dev, host = run(eng, prompts, True), run(eng, prompts, False)
            same_steps = sum(a == b for a, b in zip(dev["steps"], host["steps"]))
            res[f"{name}@{bs}"] = {
                "outputs_equal": sum(a == b for a, b in zip(dev["outputs"], host["outputs"])),
                "num_outputs": len(prompts),
                "steps_equal": same_steps,
                "num_steps": [len(dev["steps"]), len(host["steps"])],
                "metrics_device": dev["metrics"],
                "metrics_host": host["metrics"],
            }
            print(name, bs, {k: v for k, v in res[f"{name}@{bs}"].items() if not k.startswith("metrics")},
                  dev["metrics"]["mean_acceptance_length"], host["metrics"]["mean_acceptance_length"])  # fmt: skip
            del eng
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
