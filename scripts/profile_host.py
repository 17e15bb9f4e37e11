"""Where an engine step's wall time goes: host Python (cProfile) vs the device, for plain or speculative steps.

Usage:
    python scripts/profile_host.py --model MODEL --batch-size 64 [--spec-config JSON] [--steps 50] [--out F]

Fills the batch with ``--batch-size`` greedy requests (fixed output length), runs a few warm-up steps, then
times ``--steps`` ``LLMEngine.step()`` calls three ways: wall time per step, the executor's share
(``bench.engine_load.StepTimers``: forward + sampling/verification + drafting; with async output processing
the launch + the wait for the device) and, under cProfile, the host functions
with the most own time. Writes one JSON object (``--out``) and prints the cProfile table.
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats

import typer

from bench.engine_load import StepTimers
from configs import EngineConfig, SamplingParams
from flexspec.engine.llm_engine import LLMEngine


def main(
    model: str = typer.Option("smollm2-135m-instruct"),
    batch_size: int = typer.Option(64),
    spec_config: str = typer.Option("", help="speculative_config JSON (empty: plain decoding)"),
    steps: int = typer.Option(50),
    max_model_len: int = typer.Option(1024),
    out: str = typer.Option("", help="write the JSON result here"),
    top: int = typer.Option(25, help="cProfile rows to keep"),
    async_output: bool = typer.Option(True, help="overlap output processing with the next step"),
) -> None:
    cfg = EngineConfig(
        model=model,
        max_model_len=max_model_len,
        max_num_seqs=max(batch_size, 1),
        speculative_config=json.loads(spec_config) if spec_config else None,
        async_output_processing=async_output,
    )
    engine = LLMEngine(cfg)
    params = SamplingParams(max_tokens=max_model_len - 64, temperature=0.0, ignore_eos=True)
    for i in range(batch_size):
        msg = [{"role": "user", "content": f"Question {i}: a train travels {i + 3} km in {i + 2} minutes. "
                                           "How far does it go in an hour? Explain step by step."}]  # fmt: skip
        engine.add_request(engine.apply_chat_template(msg), params=params, request_id=f"r{i}")
    for _ in range(8):  # prefill + warm-up decode steps
        engine.step()
    runner = engine.executor.runner
    timers = StepTimers(engine)
    for _ in range(steps):
        timers.step()
    split = timers.summary()["decode_steps"] or timers.summary()["all_steps"]
    timers.remove()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    rows = []
    for (file, line, fn), (_, ncalls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{file.split('/')[-1]}:{line}({fn})", "calls_per_step": ncalls / steps,
                     "own_us_per_step": 1e6 * tottime / steps, "cum_us_per_step": 1e6 * cumtime / steps})  # fmt: skip
    rows.sort(key=lambda r: -r["own_us_per_step"])
    result = {
        "model": model,
        "device": str(runner.device),
        "batch_size": batch_size,
        "speculative_config": cfg.speculative_config and json.loads(spec_config),
        "steps": steps,
        "overlapped": engine.overlaps_output_processing,
        "step_split_ms": split,  # wall / executor (execute, or launch + collect) / drafting, per step
        "tokens_generated": sum(len(s.output_token_ids) for s in engine.seqs.values()),
        "cprofile_top": [
            {k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()} for r in rows[:top]
        ],
    }
    print(buf.getvalue())
    print(json.dumps({k: v for k, v in result.items() if k != "cprofile_top"}))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    typer.run(main)
