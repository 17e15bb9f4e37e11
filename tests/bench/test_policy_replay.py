"""Acceptance traces (bench.acceptance_trace) and the policy replay over them (bench.policy_replay)."""

from __future__ import annotations

import json
import random

import pytest

from bench.acceptance_trace import collect
from bench.policy_replay import apply_overrides
from bench.policy_replay import main as replay_main
from configs import SamplingParams
from tests.spec.conftest import on_worker_outputs, spec_engine


def test_trace_predicts_every_verification_of_a_real_decoupled_run(engine):
    """A trace's entry at output position L is what a verification there accepts, whatever the schedule: a
    normal decoupled run (several tokens per step) verifies at a subset of positions and must accept exactly
    the trace's numbers there, and both runs emit plain decoding's tokens."""
    from tests.conftest import real_prompts

    prompts = real_prompts(engine, n_each=1)[:2]
    spec = {"method": "dflash", "model": "smollm2-135m-instruct-dflash", "num_speculative_tokens": 6}
    eng = spec_engine({**spec, "execution": "decoupled", "device_verification": False})
    traces = collect(eng, prompts, max_tokens=24, batch_size=2)
    assert [len(t["accepted"]) for t in traces] == [t["num_output_tokens"] for t in traces]

    emitted: dict[int, int] = {}
    seen: dict[int, list[tuple[int, int]]] = {}

    def record(inp, out):
        rows = [sid for sid, smp in zip(inp.seq_ids, inp.samples) if smp]
        for sid, toks in zip(rows, out.token_ids):
            s = inp.seq_ids.index(sid)
            if inp.num_draft_tokens[s]:
                seen.setdefault(sid, []).append((emitted.get(sid, 0), len(toks) - 1))
            emitted[sid] = emitted.get(sid, 0) + len(toks)

    with on_worker_outputs(eng.executor.runner.spec_worker, record):
        outs = eng.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    plain = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    verifications = [v for sid in sorted(seen) for v in seen[sid]]
    assert len(verifications) >= 4 and any(a > 0 for _, a in verifications)
    for t, sid in zip(traces, sorted(seen)):
        for pos, accepted in seen[sid]:
            assert t["accepted"][pos] == accepted, (sid, pos)


def _docs(tmp_path, accepted: int, steps_ms: dict[str, float], prefill_ms: dict[str, float] | None = None):
    traces = {
        "schema": "flexspec.bench.acceptance_trace/1",
        "config": {"speculative_config": json.dumps({"method": "dflash", "model": "unused"})},
        "num_speculative_tokens": 8,
        "traces": {"gsm8k": [{"accepted": [None] + [accepted] * 63, "num_output_tokens": 64}] * 4},
    }
    runs = []
    for system, mode in (("plain", None), ("dflash-decoupled", "decoupled"), ("dflash-auto", None)):
        cfg = None if mode is None and system == "plain" else {"method": "dflash", "execution": mode}
        for b in (1, 4):
            run = {"dataset": "gsm8k", "system": system, "batch_size": b, "speculative_config": cfg}
            kind = "plain" if system == "plain" else "spec"
            run["step_time"] = {"decode_steps": {"step_ms": steps_ms[kind], "num_steps": 100}}
            if prefill_ms is not None:  # 10 more steps that prefilled, at prefill_ms each
                total = steps_ms[kind] * 100 + prefill_ms[kind] * 10
                run["step_time"]["all_steps"] = {"step_ms": total / 110, "num_steps": 110}
            if system == "dflash-auto":
                run["speculation_profile_ms"] = {"plain@1": 1.0, "decoupled@1": 2.0, "plain@4": 1.0}
            runs.append(run)
    (tmp_path / "t.json").write_text(json.dumps(traces))
    (tmp_path / "b.json").write_text(json.dumps({"schema": "flexspec.bench.spec/1", "runs": runs}))
    return [
        "--traces",
        str(tmp_path / "t.json"),
        "--step-times",
        str(tmp_path / "b.json"),
        "--batch-sizes",
        "1,4",
    ]


@pytest.mark.parametrize("accepted", [6, 0])
def test_replay_follows_what_the_drafts_are_worth(tmp_path, accepted):
    """7 tokens per 2 ms against 1 per 1 ms: auto speculates and gains ~3x; drafts that are never accepted:
    auto stays on plain decoding and gives up at most a few percent to probes."""
    doc = replay_main(_docs(tmp_path, accepted, {"plain": 1.0, "spec": 2.0}) + ["--max-tokens", "64"])
    for p in doc["points"]:
        if accepted:
            assert p["auto_vs_plain"] > 2.5 and p["auto_vs_best"] > 0.9
            assert p["auto_steps"].get("decoupled", 0) > p["auto_steps"].get("plain", 0)
        else:
            # at most noise above plain: the two runs draw their own 5% step-time noise (~0.3% over 256 steps)
            assert 0.95 < p["auto_vs_plain"] < 1.01 and p["decoupled"] < 0.6 * p["plain"]


def test_steps_that_prefill_cost_what_spec_bench_measured(tmp_path):
    """Steps in which requests join cost each mode's measured prefill-step time (all steps less decode steps):
    with speculative prefill steps at 40 ms against 1 ms for plain, always-decoupled loses what it gained."""
    args = _docs(tmp_path, 6, {"plain": 1.0, "spec": 2.0}, {"plain": 1.0, "spec": 40.0}) + [
        "--max-tokens",
        "64",
    ]
    priced, unpriced = replay_main(args), replay_main([*args, "--no-prefill-cost"])
    assert priced["prefill_table_ms"]["decoupled"][4] == pytest.approx(40.0)
    assert priced["prefill_table_ms"]["plain"][1] == pytest.approx(1.0)
    assert unpriced["prefill_table_ms"] == {}
    for with_cost, without in zip(priced["points"], unpriced["points"]):
        assert with_cost["plain"] == pytest.approx(without["plain"], rel=0.1)
        assert with_cost["decoupled"] < 0.8 * without["decoupled"]


def test_switch_steps_cost_what_switch_costs_say(tmp_path):
    """``--switch-costs ENTER,EXIT``: the step entering speculation and the one leaving it cost these multiples
    of a speculative step, and the replay's warm-up profile times them as the engine's does. A schedule that
    flips between the modes on every step pays them; with drafts never accepted, ``auto`` (whose profile saw
    5x switch steps) probes no more than with cheap ones and stays within 1% of plain decoding."""
    from bench.policy_replay import Replay, StepTimes
    from flexspec.spec.policy import Decision

    table = {"plain": {1: 1e-3}, "decoupled": {1: 2e-3}}
    seconds = {}
    for costs in ((1.0, 1.0), (5.0, 3.0)):
        rep = Replay(
            {"method": "dflash", "model": "unused"}, StepTimes(table, 0.0, random.Random(0)), 4, costs
        )
        flips = iter(["plain", "decoupled"] * 100)
        rep.policy.decide = lambda sched, flips=flips: Decision(next(flips), 0)
        seconds[costs] = rep.run([[None] + [0] * 63], 64, 1, None)["seconds"]
    # 63 steps (the prefill emits the first token), plain first: 31 entries, 31 exits; extra (c - 1) x 2 ms each
    assert seconds[(5.0, 3.0)] - seconds[(1.0, 1.0)] == pytest.approx(31 * 4 * 2e-3 + 31 * 2 * 2e-3)

    base = _docs(tmp_path, 0, {"plain": 1.0, "spec": 2.0}) + ["--max-tokens", "64"]
    cheap, dear = replay_main(base), replay_main([*base, "--switch-costs", "5,5"])
    for c, d in zip(cheap["points"], dear["points"]):
        assert d["auto_entries"] <= c["auto_entries"] and d["auto_vs_plain"] > 0.99


def test_the_plain_step_after_an_exit_costs_the_after_exit_cost():
    """``--after-exit-cost F``: the plain step right after the step leaving speculation (not launched ahead)
    costs F plain steps; plain steps after it, and always-plain decoding, cost one."""
    from bench.policy_replay import Replay, StepTimes
    from flexspec.spec.policy import Decision

    table = {"plain": {1: 1e-3}, "decoupled": {1: 2e-3}}
    seconds = {}
    for f in (1.0, 3.0):
        rep = Replay(
            {"method": "dflash", "model": "unused"}, StepTimes(table, 0.0, random.Random(0)), 4, (1, 1), f
        )
        cycle = iter(["plain", "decoupled", "plain", "plain"] * 100)  # enter, exit, the step after, ...
        rep.policy.decide = lambda sched, cycle=cycle: Decision(next(cycle), 0)
        seconds[f] = rep.run([[None] + [0] * 63], 64, 1, None)["seconds"]
        assert rep.run([[None] + [0] * 63], 64, 1, "plain")["seconds"] == pytest.approx(63e-3)
    # 63 steps: 15 full cycles and 3 steps, 15 steps after an exit (each 2 ms more)
    assert seconds[3.0] - seconds[1.0] == pytest.approx(15 * 2e-3)


def test_each_ranking_decision_costs_the_ranking_cost():
    """``--ranking-cost-ms``: every decision that ranks the options (``SpeculationPolicy.num_rankings``) adds that
    much host time to its step; held decisions and fixed modes add none."""
    from bench.policy_replay import Replay, StepTimes

    table = {"plain": {1: 1e-3}, "decoupled": {1: 4e-3}}
    runs = {}
    for cost in (0.0, 1e-4):
        rep = Replay(
            {"method": "dflash", "model": "unused"},
            StepTimes(table, 0.0, random.Random(0)),
            4,
            (1, 1),
            1.0,
            cost,
        )
        rep.policy.forced = None
        out = rep.run([[None] + [0] * 255], 256, 1, None)
        runs[cost] = (out["seconds"], rep.policy.num_rankings)
        assert rep.run([[None] + [0] * 63], 64, 1, "plain")["seconds"] == pytest.approx(63e-3)
        assert rep.policy.num_rankings == runs[cost][1]  # a fixed mode ranks nothing
    assert runs[0.0][1] == runs[1e-4][1] > 20  # the same decisions (plain held: HOLD_STEPS)
    assert runs[1e-4][0] - runs[0.0][0] == pytest.approx(runs[0.0][1] * 1e-4)


def test_overrides_name_real_constants():
    from flexspec.spec import policy_tuning as policy

    old = policy.REQUEST_PRIOR_WEIGHT, policy.STALE_HALF_LIFE, policy.STALE_KEEP, policy.PROBE_BUDGET
    switch = policy.ENTER_AT_JOIN
    try:
        assert apply_overrides(["REQUEST_PRIOR_WEIGHT=32", "STALE_HALF_LIFE=4"]) == {
            "REQUEST_PRIOR_WEIGHT": 32,
            "STALE_HALF_LIFE": 4,
        }
        assert policy.STALE_KEEP == pytest.approx(0.5**0.25)
        assert apply_overrides(["PROBE_BUDGET=0"]) == {"PROBE_BUDGET": 0.0}  # documented: 0 = no limit
        assert apply_overrides(["ENTER_AT_JOIN=0"]) == {"ENTER_AT_JOIN": False}  # a switch
        assert apply_overrides(["ENTER_AT_JOIN=true"]) == {"ENTER_AT_JOIN": True}
    finally:
        policy.REQUEST_PRIOR_WEIGHT, policy.STALE_HALF_LIFE, policy.STALE_KEEP, policy.PROBE_BUDGET = old
        policy.ENTER_AT_JOIN = switch
    with pytest.raises(ValueError, match="NO_SUCH"):
        apply_overrides(["NO_SUCH=1"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (["--traces", "/nonexistent.json"], "cannot read /nonexistent.json"),
        (["--set", "NOPE=1"], "no constant 'NOPE'"),
        (["--profile-trace", "humaneval:0"], "no dataset 'humaneval'"),
        (["--profile-trace", "gsm8k:99"], "gsm8k has requests 0..3"),
        (["--set", "REQUEST_PRIOR_WEIGHT=abc"], "'abc' is not a number"),
        (["--set", "STALE_HALF_LIFE=0"], "STALE_HALF_LIFE takes a positive int"),
        (["--set", "PRIOR_HALF_LIFE=inf"], "PRIOR_HALF_LIFE takes a positive int"),
        (["--set", "PROBE_BUDGET=-1"], "PROBE_BUDGET takes a non-negative float"),
        (["--set", "PRIOR_MIN_WEIGHT=nan"], "PRIOR_MIN_WEIGHT takes a positive float"),
        (["--set", "PRIOR_KEEP=2"], "follows PRIOR_HALF_LIFE; set that instead"),
        (["--set", "ENTER_AT_JOIN=2"], "ENTER_AT_JOIN takes 0 / 1"),
        (["--datasets", ""], "--datasets ''"),
        (["--datasets", "gsm8k,nope"], "the traces hold"),
        (["--switch-costs", "2"], "expected ENTER,EXIT"),
        (["--switch-costs", "0,1"], "both multiples must be positive"),
        (["--spells", "0.1,8"], "expected RATE,STEPS,EXTRA_MS"),
        (["--spells", "2,8,1"], "RATE must be in [0, 1]"),
        (["--after-exit-cost", "0.5"], "--after-exit-cost 0.5: must be >= 1"),
        (["--ranking-cost-ms", "-1"], "--ranking-cost-ms -1.0: must be >= 0"),
        (["swap"], "is not a flexspec.bench.acceptance_trace result"),
    ],
)
def test_bad_input_is_one_usage_error(tmp_path, capsys, change, message):
    args = _docs(tmp_path, 1, {"plain": 1.0, "spec": 2.0})
    if change == ["swap"]:  # the step-times JSON given as traces
        args[1] = args[3]
    else:
        args += change
        if change[0] == "--traces":
            args = args[2:]
    with pytest.raises(SystemExit) as exc:
        replay_main(args)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_replay_chooses_among_chain_lengths(tmp_path):
    """A spec_bench system of fewer drafts than the traces' k is the policy's "decoupled/N" option: with 2 drafts
    accepted everywhere, chains of 3 (3 tokens per 1.5 ms) beat chains of 8 (3 per 4 ms) and plain decoding (1 per
    1 ms); auto runs them, its cut chains accepted whole, and no worse than the best fixed mode by much."""
    args = _docs(tmp_path, 2, {"plain": 1.0, "spec": 4.0})
    bench = json.loads((tmp_path / "b.json").read_text())
    for b in (1, 4):
        bench["runs"].append(
            {"dataset": "gsm8k", "system": "dflash-k3", "batch_size": b, "num_speculative_tokens": 3,
             "speculative_config": {"method": "dflash", "execution": "decoupled", "num_speculative_tokens": 3},
             "step_time": {"decode_steps": {"step_ms": 1.5, "num_steps": 100}}}
        )  # fmt: skip
    (tmp_path / "b.json").write_text(json.dumps(bench))
    doc = replay_main([*args, "--max-tokens", "64"])
    assert doc["table_ms"]["decoupled/3"] == {1: 1.5, 4: 1.5}
    for p in doc["points"]:
        assert p["decoupled/3"] > 1.5 * p["plain"] > 1.5 * p["decoupled"]
        assert p["auto_steps"].get("decoupled/3", 0) > 0.8 * sum(p["auto_steps"].values()), p["auto_steps"]
        assert p["auto_vs_best"] > 0.9


def test_spells_slow_every_mode_for_their_steps():
    """``--spells RATE,STEPS,EXTRA_MS``: a spell adds EXTRA_MS to STEPS consecutive steps, whatever their mode
    (slow stretches run in multiples of STEPS: a spell may start right after another)."""
    from bench.policy_replay import StepTimes

    table = {"plain": {1: 1e-3}, "decoupled": {1: 2e-3}}
    times = StepTimes(table, 0.0, random.Random(0), spells=(0.05, 4, 10.0))
    modes = ["plain", "decoupled"] * 1000
    slow = [times.sample(m, 1) - times.mean(m, 1) > 5e-3 for m in modes]
    assert 0.05 < sum(slow) / len(slow) < 0.4
    runs = [len(r) for r in "".join("x" if s else " " for s in slow).split()]
    assert runs and all(r % 4 == 0 for r in runs)
    calm = StepTimes(table, 0.0, random.Random(0))
    assert all(calm.sample(m, 1) == calm.mean(m, 1) for m in modes)
