"""Per-step decision log of the speculation policy (``execution: auto``) on real prompts, to see why it picks
plain decoding where a fixed speculative mode is faster (issue 6).

Usage:
    python scripts/policy_log.py --dataset gsm8k --num-prompts 16 --batch-size 1 --max-tokens 128 --out log.json

Builds one engine (default: the shipped DFlash drafter, warm-up profile as configured), generates the prompts
with ``--batch-size`` running at most, and records for every decision: the mode chosen, the batch size, the
prior G, the batch's MAL estimate, each option's expected rate (tokens/s per sequence, before margins and entry
costs) and estimated step time, and for each scheduled request its running MAL r, verifications n and evidence
weight w; and for every step the engine timed (``steps``): its mode, the decision before it, its wall time,
whether the policy recorded it as that mode's step time, and the drafts it accepted. Writes the log and a
summary (share of plain steps, lengths of plain stretches, mean estimate at plain vs speculative decisions).
"""

from __future__ import annotations

import cProfile
import json
import pstats
import statistics
import time
from pathlib import Path

import pydantic
import typer

from configs import EngineConfig, SamplingParams
from flexspec.datasets import load_prompts
from flexspec.engine.llm_engine import LLMEngine
from flexspec.spec.step_times import batch_bucket


def _check_output(path: str, option: str) -> None:
    """Fail before the engine is built (not after the generation) when ``path`` cannot be written as a file."""
    p = Path(path)
    if p.is_dir():
        raise typer.BadParameter(f"{path!r} is a directory", param_hint=option)
    if not p.parent.is_dir():
        raise typer.BadParameter(f"directory {str(p.parent)!r} does not exist", param_hint=option)


def _finite(rate: float) -> float | None:
    """A rate for strict JSON: None where the mode has no step time yet (the policy's inf)."""
    return None if rate == float("inf") else round(rate, 2)


def main(
    model: str = typer.Option("smollm2-135m-instruct"),
    speculative_config: str = typer.Option(
        '{"method": "dflash", "model": "smollm2-135m-instruct-dflash"}', help="JSON"
    ),
    dataset: str = typer.Option("gsm8k"),
    num_prompts: int = typer.Option(16),
    batch_size: int = typer.Option(1),
    max_tokens: int = typer.Option(128),
    out: str = typer.Option("policy_log.json"),
    force: str | None = typer.Option(
        None,
        help="hold every decision on this option (plain, decoupled/L, decoupled, parallel: the policy's "
        "options) after the warm-up profile (on a GPU; off on CPU); the steps' wall times are logged, the "
        "policy's estimates stay the profile's",
    ),
    profile: str | None = typer.Option(
        None,
        help="also write the host profile (cProfile, top functions by own and cumulative time) here; the "
        "summary's tokens_per_s then includes the profiler's overhead",
    ),
) -> None:
    """Log every decision of the auto speculation policy on real prompts (see the module doc); JSON out."""
    _check_output(out, "--out")
    if profile:
        _check_output(profile, "--profile")
    try:
        config = EngineConfig(
            model=model,
            max_model_len=2048,
            max_num_seqs=batch_size,
            speculative_config=json.loads(speculative_config),
        )
    except (json.JSONDecodeError, pydantic.ValidationError) as e:
        raise typer.BadParameter(str(e), param_hint="--speculative-config") from None
    engine = LLMEngine(config)
    policy = engine.policy
    if policy is None or policy.spec.execution != "auto":
        raise typer.BadParameter("needs a speculative config with execution 'auto'")
    if force is not None and force not in policy.options:
        raise typer.BadParameter(
            f"--force {force!r} is not one of the policy's options {list(policy.options)}"
        )
    policy.forced = force
    log: list[dict] = []
    decide = policy.decide

    def logged(sched):
        d = decide(sched)
        bucket = batch_bucket(len(sched.scheduled))
        est = policy.batch_tokens_per_step(sched)
        log.append(
            {
                "mode": d.option,
                "batch": len(sched.scheduled),
                "prior": round(policy.prior(), 3),
                "estimate": round(est, 3),
                "rates": {
                    m: _finite(policy.expected_rate(m, bucket, policy.option_tokens(m, est)))
                    for m in policy.options
                },
                "step_ms": {m: round((policy.step_time(m, bucket) or 0.0) * 1e3, 4) for m in policy.options},
                "requests": [  # r: running MAL (None before its first verification), n, w
                    {
                        "r": s.seq.spec_tokens_per_step,
                        "n": s.seq.spec_num_verifications,
                        "w": round(s.seq.spec_estimate_weight, 3),
                    }
                    for s in sched.scheduled
                ],
            }
        )
        return d

    policy.decide = logged
    timed: list[dict] = []  # every step the engine reported: its mode, wall time, and whether it was recorded
    observe = policy.observe

    def observed(mode, num_seqs, seconds, per_position_acceptance, previous=None, verified_length=None):
        previous = policy.previous_mode(mode, previous)
        timed.append(
            {
                "mode": mode,
                "previous": previous,
                "batch": num_seqs,
                "ms": None if seconds is None else round(seconds * 1e3, 4),
                "recorded": seconds is not None and previous == mode,
                # drafts accepted per sequence (mean over the batch), None for a step that verified none
                "accepted": round(sum(per_position_acceptance), 3) if per_position_acceptance else None,
            }
        )
        observe(
            mode,
            num_seqs,
            seconds,
            per_position_acceptance,
            previous=previous,
            verified_length=verified_length,
        )

    policy.observe = observed
    prompts = [
        engine.apply_chat_template([{"role": "user", "content": p["prompt"]}])
        for p in load_prompts(dataset, limit=num_prompts)
    ]
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    if prof is not None:
        prof.disable()
    wall = time.perf_counter() - t0
    if prof is not None:
        with open(profile, "w") as f:  # type: ignore[arg-type]
            for order in ("tottime", "cumulative"):
                pstats.Stats(prof, stream=f).sort_stats(order).print_stats(50)
    # one letter per decision: p(lain), d(ecoupled, any chain length), q (parallel)
    modes = "".join({"plain": "p", "parallel": "q"}.get(e["mode"], "d") for e in log)
    plain_runs = [len(r) for r in modes.replace("d", " ").replace("q", " ").split() if r]
    mean = lambda xs: round(statistics.fmean(xs), 3) if xs else None
    summary = {
        "decisions": len(log),
        "plain_share": round(modes.count("p") / max(len(modes), 1), 3),
        "plain_stretches": len(plain_runs),
        "plain_stretch_mean": mean(plain_runs),
        "estimate_at_plain": mean([e["estimate"] for e in log if e["mode"] == "plain"]),
        "estimate_at_spec": mean([e["estimate"] for e in log if e["mode"] != "plain"]),
        "output_tokens": sum(len(o.token_ids) for o in outs),
        "tokens_per_s": round(sum(len(o.token_ids) for o in outs) / wall, 1),
        "mal": round(engine.spec_metrics.mean_acceptance_length, 3),
        "step_times_ms": policy.estimates_ms(),  # as the policy uses them (switch steps: switch_time)
        "speculation_profile_ms": engine.speculation_profile,
        "modes": modes,
    }
    with open(out, "w") as f:
        json.dump({"summary": summary, "log": log, "steps": timed}, f)
    print(json.dumps({k: v for k, v in summary.items() if k != "modes"}))


if __name__ == "__main__":
    typer.run(main)
