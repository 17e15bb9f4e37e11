"""The per-batch execution policy (issue 6): measured step times and acceptance decide the mode."""

from __future__ import annotations

import itertools
import math

import pytest

from configs import EngineConfig
from flexspec.engine.scheduler import SchedulerOutput
from flexspec.spec import policy_tuning
from flexspec.spec.policy import Decision, SpeculationPolicy, entry_factor
from flexspec.spec.policy_tuning import (
    EMA,
    MIN_PRIOR_VERIFICATIONS,
    PRIOR_HALF_LIFE,
    PRIOR_MIN_WEIGHT,
    PRIOR_WINDOW,
    PROBE_BUDGET,
    PROBE_STEPS,
    REEXPLORE_EVERY,
    REEXPLORE_MAX,
    REQUEST_PRIOR_WEIGHT,
    SPEC_MARGIN,
    STALE_AFTER,
    STALE_HALF_LIFE,
    STALE_KEEP,
    SWITCH_HORIZON,
    WARMUP_SAMPLES,
)


def _sched(n: int) -> SchedulerOutput:
    return SchedulerOutput(scheduled=[object()] * n, preempted=[])  # type: ignore[list-item]


def _policy(**spec) -> SpeculationPolicy:
    sc = {"method": "flexdraft", "model": "unused", "num_speculative_tokens": 4, **spec}
    return SpeculationPolicy(EngineConfig(speculative_config=sc))


def _train(policy, n, times, acceptance):
    for _ in range((WARMUP_SAMPLES + 1) * 3):  # each mode's first step is a switch step (not recorded)
        d = policy.decide(_sched(n))
        policy.observe(d.mode, n, times[d.mode], acceptance if d.mode != "plain" else None)


def test_warmup_measures_every_mode_then_picks_the_fastest():
    pol = _policy()
    times = {"plain": 1.0, "decoupled": 1.5, "parallel": 1.2}  # seconds per step
    _train(pol, 1, times, [0.9, 0.8, 0.7, 0.6])  # E[tokens] = 4.0
    assert {m for (m, _) in pol.step_times if ":" not in m} == {"plain", "decoupled", "parallel"}
    assert pol.decide(_sched(1)).mode == "parallel"  # 4.0 / 1.2 beats 4.0 / 1.5 and 1 / 1.0


def test_large_batch_where_speculation_does_not_pay_falls_back_to_plain():
    pol = _policy()
    _train(pol, 64, {"plain": 1.0, "decoupled": 2.5, "parallel": 9.0}, [0.5, 0.3, 0.1, 0.05])  # E = 1.95
    d = pol.decide(_sched(64))
    assert d.mode == "plain" and d.num_speculative_tokens == 0


def test_buckets_are_independent_and_runner_up_is_remeasured(monkeypatch):
    times, acceptance = {"plain": 1.0, "decoupled": 1.35, "parallel": 1.2}, [0.9, 0.8, 0.7, 0.6]

    def modes_after_training(n: int) -> list[str]:
        pol = _policy()
        _train(pol, 1, times, acceptance)
        modes = []
        for _ in range(n):
            d = pol.decide(_sched(1))
            modes.append(d.mode)
            pol.observe(d.mode, 1, times[d.mode], acceptance if d.mode != "plain" else None)
        assert pol.decide(_sched(33)).mode in {"plain", "decoupled", "parallel"}  # new bucket: warm-up again
        return modes

    modes = modes_after_training(400)
    assert modes.count("parallel") > 380 and "decoupled" in modes  # periodic re-exploration (plausible)
    # 1 token / 1.0 s is far below 4 / 1.2, but plain is re-measured all the same (ALWAYS_PROBE_PLAIN), its
    # probes PROBE_STEPS long
    assert 0 < modes.count("plain") <= 2 * PROBE_STEPS
    monkeypatch.setattr(policy_tuning, "ALWAYS_PROBE_PLAIN", False)
    modes = modes_after_training(400)
    assert "plain" not in modes and "decoupled" in modes  # without it: only options within PROBE_WITHIN


def test_overrides_and_disable_by_batch_size():
    assert _policy(execution="decoupled").decide(_sched(3)).mode == "decoupled"
    pol = _policy(execution="parallel", disable_by_batch_size=8)
    assert pol.decide(_sched(8)).mode == "parallel"
    assert pol.decide(_sched(9)).mode == "plain"
    with pytest.raises(ValueError, match="flexdraft"):
        SpeculationPolicy(EngineConfig(speculative_config={"method": "ngram", "execution": "parallel"}))


def test_new_batch_size_reuses_estimates_and_skips_options_that_cannot_win():
    pol = _policy()
    times = {"plain": 1.0, "decoupled": 1.3, "parallel": 9.0}
    _train(pol, 64, times, [0.5, 0.3, 0.1, 0.05])  # E = 1.95: decoupled 1.5/s, plain 1/s, parallel 0.2/s
    modes = []
    for _ in range(40):  # batch drains to a new bucket: parallel's borrowed estimate is far below the best
        d = pol.decide(_sched(20))
        modes.append(d.mode)
        pol.observe(d.mode, 20, times[d.mode] * 0.5, [0.5, 0.3, 0.1, 0.05] if d.mode != "plain" else None)
    assert "parallel" not in modes
    assert modes.count("decoupled") >= 36


def test_first_samples_keep_their_minimum():
    pol = _policy()
    pol.observe("plain", 1, 5.0, None)  # e.g. a first-call compile
    pol.observe("plain", 1, 1.0, None)
    assert pol.step_time("plain", 1) == 1.0
    assert pol.step_time("decoupled", 1) is None


def test_per_request_acceptance_decides_for_the_batch_at_hand():
    from types import SimpleNamespace

    pol = _policy(execution="auto")
    times = {"plain": 1.0, "decoupled": 1.5, "parallel": 9.0}
    _train(pol, 4, times, [0.9, 0.8, 0.7, 0.6])  # running statistics: E = 4.0 -> decoupled wins
    assert pol.decide(_sched(4)).mode == "decoupled"
    poor = [SimpleNamespace(seq=SimpleNamespace(spec_tokens_per_step=None)) for _ in range(4)]
    for item in poor:  # these requests' own drafts are rejected: 1 token per step
        for _ in range(20):
            pol.observe_request(item.seq, 4, 0)
    assert all(abs(item.seq.spec_tokens_per_step - 1.0) < 1e-9 for item in poor)
    batch = SchedulerOutput(scheduled=poor, preempted=[])  # type: ignore[arg-type]
    assert pol.decide(batch).mode == "plain"  # 1 / 1.5 s < 1 / 1.0 s


def test_positions_without_drafts_count_as_not_accepted():
    pol = _policy()
    pol.observe("decoupled", 1, 1.0, [0.9, 0.9, 0.9, 0.9])
    for _ in range(30):  # later steps verify one draft only: positions 2-4 accept nothing any more
        pol.observe("decoupled", 1, 1.0, [0.5])
    assert pol.expected_tokens_per_step("decoupled") == pytest.approx(1.5, abs=0.01)


def test_only_steady_state_steps_are_timed():
    """A step after a mode switch verifies the previous mode's drafts: its time belongs to neither mode. Switches
    between plain decoding and a speculative mode are timed as switch steps (``switch_time``)."""
    pol = _policy(execution="auto")
    seen = []
    for _ in range((WARMUP_SAMPLES + 1) * 3):
        d = pol.decide(_sched(2))
        switch = len(seen) > 0 and seen[-1] != d.mode
        seen.append(d.mode)
        pol.observe(d.mode, 2, 100.0 if switch else 1.0, None)  # switch steps are slow outliers
    steady = {k: st for k, st in pol.step_times.items() if ":" not in k[0]}
    assert {m for (m, _) in steady} == {"plain", "decoupled", "parallel"}
    assert all(st.seconds == 1.0 for st in steady.values())
    switches = {k[0] for k in pol.step_times} - set(pol.options)
    assert "enter:decoupled" in switches and switches <= {
        f"{k}:{m}" for k in ("enter", "exit") for m in pol.options
    }
    assert all(pol.switch_time(*k.split(":"), 2) == 100.0 for k in switches)


def test_a_pessimistic_estimate_is_probed_again():
    """Decoupled looked bad once (0.65 of plain): it is still re-measured, for its probe's steps in a row, and
    wins once its real time shows. The probe waits until it costs at most PROBE_BUDGET of the throughput: its
    3 steps of 3.0 emit 1 + 2 x 1.95 tokens where plain emits 9, 4.1 s lost, so after ~410 plain steps."""
    pol = _policy(execution="auto")
    times = {"plain": 1.0, "decoupled": 3.0, "parallel": 50.0}
    _train(pol, 4, times, [0.5, 0.3, 0.1, 0.05])  # decoupled: 1.95 / 3.0 = 0.65 of plain
    times["decoupled"] = 1.2  # the real steady-state cost: 1.95 / 1.2 beats plain
    modes = []
    for _ in range(800):
        d = pol.decide(_sched(4))
        modes.append(d.mode)
        pol.observe(d.mode, 4, times[d.mode], [0.5, 0.3, 0.1, 0.05] if d.mode != "plain" else None)
    first = modes.index("decoupled")
    assert 4.1 / PROBE_BUDGET - 20 <= first <= 4.1 / PROBE_BUDGET  # (less the warm-up decisions counted)
    assert modes[first + 1] == "decoupled"  # a probe is two steps: the first is a switch step
    assert modes[-100:].count("decoupled") > 90
    assert "parallel" not in modes  # 50x slower: never probed


def test_probes_of_a_runner_up_that_keeps_losing_back_off():
    """The runner-up's re-measurements come after 64, then 128, 256, ... decisions of the bucket (up to
    REEXPLORE_MAX), and never more often than PROBE_BUDGET allows (here >= 315 decisions apart, below). One that
    measures far from its estimate starts the back-off over."""
    pol = _policy(execution="auto")
    times = {"plain": 1.0, "decoupled": 2.5, "parallel": 50.0}
    _train(
        pol, 4, times, [0.5, 0.3, 0.1, 0.05]
    )  # decoupled: 1.95 / 2.5 = 0.78 of plain: probed, never chosen
    modes = []
    for _ in range(4000):
        d = pol.decide(_sched(4))
        leaving = (
            modes and modes[-1] == "decoupled" and d.mode == "plain"
        )  # verifies: a decoupled step's time
        modes.append(d.mode)
        t = times["decoupled"] if leaving else times[d.mode]
        pol.observe(d.mode, 4, t, [0.5, 0.3, 0.1, 0.05] if d.mode != "plain" else None)
    starts = [i for i, m in enumerate(modes) if m == "decoupled" and (i == 0 or modes[i - 1] != "decoupled")]
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert all(modes[i + 1] == "decoupled" for i in starts)  # each probe: PROBE_STEPS steps
    # once the step leaving speculation was timed, a probe is priced with both switch steps: entering (2.5 s,
    # 1 token), 2 verifying steps, leaving (2.5 s, 1.95 tokens): 10 s for 6.85 tokens, 3.15 s lost
    assert gaps[:3] == [315, 315, 512] and max(gaps) == REEXPLORE_MAX  # (every 64 before: 62 probes)
    assert len(starts) == 6  # in 4000 decisions
    times["decoupled"] = 1.2  # conditions changed: the next probe measures 1.2 against an estimate of 2.5
    for _ in range(1200):
        d = pol.decide(_sched(4))
        modes.append(d.mode)
        pol.observe(d.mode, 4, times[d.mode], [0.5, 0.3, 0.1, 0.05] if d.mode != "plain" else None)
    assert modes[-100:].count("decoupled") > 90  # re-probed at once after the surprise: the median moved


def _run(pol, times, acceptance, steps, n=1):
    modes = []
    for _ in range(steps):
        d = pol.decide(_sched(n))
        modes.append(d.mode)
        pol.observe(d.mode, n, times[d.mode], acceptance if d.mode != "plain" else None)
    return modes


def test_a_mode_left_in_a_slow_spell_is_tried_again_once_its_estimate_is_stale():
    """Speculative step times wander in spells (H200, batch 1, session 16): decoupled left during a slow spell
    kept the spell's median until the runner-up probe (whose two samples did not move a median of 15). Stale
    after STALE_AFTER decisions, its estimate falls back to the long-run median; the return measures afresh."""
    pol = _policy(execution="auto")
    acceptance = [
        0.6,
        0.4,
        0.3,
        0.2,
    ]  # E[tokens] = 2.5: 2.5 / 1.5 s beats plain (1.05 / 1.0 s with the margin)
    times = {"plain": 1.0, "decoupled": 1.5, "parallel": 50.0}
    _train(pol, 1, times, acceptance)
    assert _run(pol, times, acceptance, 200)[-150:].count("decoupled") > 140  # plain: probes only
    times["decoupled"] = 3.0  # a slow spell: 2.5 / 3.0 s loses to plain
    spell = _run(pol, times, acceptance, 40)
    assert spell[-10:] == ["plain"] * 10
    times["decoupled"] = 1.5  # the spell is over
    after = _run(pol, times, acceptance, 200)
    back = after.index("decoupled")
    assert back <= STALE_AFTER + 1  # not after the probe back-off (64 decisions and more)
    assert after[back:].count("decoupled") > 0.95 * (
        len(after) - back
    )  # measured afresh: one fast step does it
    times["decoupled"] = 3.0  # a spell that lasts: tried again every ~STALE_AFTER decisions, left each time
    lasting = _run(pol, times, acceptance, 1000)[100:]
    assert 0 < lasting.count("decoupled") < 4 * len(lasting) / STALE_AFTER


def test_entering_and_leaving_speculation_count_the_draftless_step():
    """With E[tokens] between the steady-state break-even (2.1 with the margin) and the one that pays for the
    draftless first speculative step (entry_factor), the policy keeps whichever mode it is in: no flip-flop."""
    pol = _policy(execution="auto")
    _train(pol, 1, {"plain": 1.0, "decoupled": 2.0, "parallel": 50.0}, [0.5, 0.3, 0.1, 0.05])
    pol.prior_tokens_per_step = 2.15  # every request's estimate (none has evidence of its own)
    pol.num_verifications = MIN_PRIOR_VERIFICATIONS  # G is trusted
    steady = 2.0 * SPEC_MARGIN
    assert steady < 2.15 and 2.15 * entry_factor(2.15) < steady  # inside the band
    pol.last_modes = ["plain"]
    assert pol.decide(_sched(1)).mode == "plain"  # entering would not pay back over the stretch
    pol.last_modes = ["decoupled"]
    assert pol.decide(_sched(1)).mode == "decoupled"  # and neither would leaving
    pol.prior_tokens_per_step = 3.0  # clearly above: entered from plain
    pol.last_modes = ["plain"]
    assert pol.decide(_sched(1)).mode == "decoupled"


# ---- per-request estimates: shrinkage toward the prior and ageing while plain (issue 6, batch 1) -------------
def _request():
    from types import SimpleNamespace

    seq = SimpleNamespace(spec_tokens_per_step=None, spec_estimate_weight=1.0)
    return seq, SchedulerOutput(scheduled=[SimpleNamespace(seq=seq)], preempted=[])  # type: ignore[list-item]


def _plain_steps_to_break_even(prior: float, own: float, break_even: float, n: int) -> int:
    """Plain steps after which G + c w (r - G) reaches ``break_even`` (w = STALE_KEEP ** steps, c the weight of
    ``n`` verifications)."""
    c = n / (n + REQUEST_PRIOR_WEIGHT)
    return math.ceil(math.log((prior - break_even) / (c * (prior - own))) / math.log(STALE_KEEP))


def test_a_request_on_plain_is_speculated_on_again_and_returns_to_plain_while_its_drafts_fail():
    pol = _policy(execution="auto")
    times = {"plain": 1.0, "decoupled": 1.5, "parallel": 9.0}  # break-even MAL of decoupled: 1.5
    _train(pol, 1, times, [0.9, 0.8, 0.7, 0.6])
    other, _ = _request()
    for _ in range(100):  # the population: 3 tokens per verification
        pol.observe_request(other, 4, 2)
    seq, batch = _request()
    for _ in range(60):  # this request's drafts were rejected 60 times in a row
        pol.observe_request(seq, 4, 0)
    prior, own = pol.prior(), seq.spec_tokens_per_step
    assert prior > 2.0 and own < 1.1
    # plain wins near-ties, and entering speculation must pay for its draftless first step (m e(m) = b):
    break_even = (SWITCH_HORIZON * 1.5 * SPEC_MARGIN - 1) / (SWITCH_HORIZON - 1)
    assert break_even * entry_factor(break_even) == pytest.approx(1.5 * SPEC_MARGIN)
    n = _plain_steps_to_break_even(prior, own, break_even, 60)
    assert (
        1 <= n <= STALE_HALF_LIFE
    )  # r ~ 1, G ~ 2.2, c = 60 / 92: the own estimate must lose a little weight
    modes = []
    for _ in range(n + 1):
        modes.append(pol.decide(batch).mode)
        if modes[-1] == "plain":
            pol.observe_request(seq, 0, 0)  # the next step emits without verifying drafts
    assert modes == ["plain"] * n + ["decoupled"]
    pol.observe_request(seq, 4, 0)  # speculated on again: the drafts still fail
    assert seq.spec_estimate_weight == 1.0 and pol.decide(batch).mode == "plain"  # back to plain at once
    modes = []
    for _ in range(200):  # from then on: one verification per ~n plain steps (plus the runner-up probes)
        modes.append(pol.decide(batch).mode)
        pol.observe_request(seq, 4 if modes[-1] == "decoupled" else 0, 0)
    seen = "".join(m[0] for m in modes)
    # G drops with each failure, so n grows, but the request is tried again within two half-lives of the decay
    assert max(len(r) for r in seen.split("d") if r) <= 2 * STALE_HALF_LIFE
    assert seen.count("dd") <= 200 // REEXPLORE_EVERY + 1  # a failed verification is followed by plain steps
    assert seen.count("d") <= 200 / n + 2 * 200 / REEXPLORE_EVERY


def test_one_unlucky_first_verification_does_not_send_a_request_to_plain():
    """A request's running MAL starts from the prior: one rejection moves it EMA of the way, not all the way."""
    pol = _policy(execution="auto")
    _train(pol, 1, {"plain": 1.0, "decoupled": 1.5, "parallel": 9.0}, [0.9, 0.8, 0.7, 0.6])
    other, _ = _request()
    for _ in range(50):
        pol.observe_request(other, 4, 2)
    seq, batch = _request()
    pol.observe_request(seq, 4, 0)
    assert seq.spec_tokens_per_step == pytest.approx((1 - EMA) * pol.prior() + EMA * 1.0)  # G ~ 3
    assert pol.decide(batch).mode == "decoupled"


def test_a_short_unlucky_streak_early_in_a_request_does_not_send_it_to_plain():
    """Session 12 (H200, batch 1): decoupled steps cost 2.25 plain ones, break-even MAL 2.36; with the
    request's own EMA at full weight, three rejections in a row (3 -> 2.02) sent GSM8K requests (G ~3) to plain
    half the time. The own evidence of n verifications weighs n / (n + REQUEST_PRIOR_WEIGHT)."""
    pol = _policy(execution="auto")
    _train(pol, 1, {"plain": 1.0, "decoupled": 2.25, "parallel": 9.0}, [0.9, 0.8, 0.7, 0.6])
    other, _ = _request()
    for _ in range(100):
        pol.observe_request(other, 4, 2)
    seq, batch = _request()
    for _ in range(3):
        pol.observe_request(seq, 4, 0)
    assert seq.spec_tokens_per_step < 2.1 and pol.prior() > 2.9  # at full weight: below break-even
    assert pol.decide(batch).mode == "decoupled"
    for _ in range(25):  # a long run of failures is evidence: plain
        pol.observe_request(seq, 4, 0)
    assert pol.decide(batch).mode == "plain"


def test_batch1_gsm8k_auto_stays_on_speculation_and_returns_soon_after_plain_steps():
    """Real engine and shipped DFlash drafter on a GSM8K prompt at batch 1. Step times come from a fixed cost
    model (decoupled = 2 plain steps: break-even MAL 2.1 with the margin, so the shipped drafter has requests on
    both sides), so the decisions depend on acceptance only, not on CPU timing.
    Before the estimate aged while plain, a request stayed on plain until the runner-up probe (64 decisions);
    while a request's own evidence weighed half at 8 verifications, runs of rejections sent this one to plain
    (session 13 on the H200: 54% of GSM8K's batch-1 steps plain)."""
    from configs import SamplingParams
    from flexspec.datasets import load_prompts
    from tests.spec.conftest import spec_engine

    eng = spec_engine({"method": "dflash", "model": "smollm2-135m-instruct-dflash", "execution": "auto",
                       "draft_lengths": [15]}, max_num_seqs=1)  # fmt: skip
    pol = eng.policy
    cost = {"plain": 1.0, "decoupled": 2.0}
    observe, observe_request, age_requests, decide = (
        pol.observe,
        pol.observe_request,
        pol.age_requests,
        pol.decide,
    )
    modes: list[str] = []
    calls = []

    def counted_observe_request(seq, num_draft_tokens, num_accepted, draft_length=None):
        calls.append(seq.seq_id)
        observe_request(seq, num_draft_tokens, num_accepted, draft_length)

    def counted_age_requests(seqs):  # rows of a step that verified no drafts for them
        calls.extend(seq.seq_id for seq in seqs)
        age_requests(seqs)

    pol.observe = lambda m, n, _s, acc, previous=None, **kw: observe(m, n, cost[m], acc, previous, **kw)
    pol.observe_request, pol.age_requests = counted_observe_request, counted_age_requests
    pol.decide = lambda sched: modes.append(decide(sched).mode) or Decision(modes[-1], 0 if modes[-1] == "plain" else
                                                                             pol.spec.num_speculative_tokens)  # fmt: skip
    prompt = load_prompts("gsm8k", limit=1)[0]["prompt"]
    eng.generate([eng.apply_chat_template([{"role": "user", "content": prompt}])],
                 SamplingParams(max_tokens=128, temperature=0))  # fmt: skip
    # one update per emitting step (the prompt fits one step), except the steps entering speculation: they draft
    # without verifying, and do not age the request's estimate (a plain step would)
    entries = sum(m != "plain" and (i == 0 or modes[i - 1] == "plain") for i, m in enumerate(modes))
    assert entries > 0 and len(calls) + entries == eng.stats.num_steps
    assert pol.prior() > 2.0  # the drafter works: a wrong plain step loses > 1 token
    after_warmup = "".join(m[0] for m in modes[2 * (WARMUP_SAMPLES + 1) :])
    runs = [len(r) for r in after_warmup.split("d") if r]
    assert (
        max(runs, default=0) <= STALE_HALF_LIFE + PROBE_STEPS
    )  # plain stretches end within the decay's horizon
    assert after_warmup.count("d") > 0.9 * len(after_warmup)


def test_steps_without_a_time_update_acceptance_only():
    pol = _policy()
    pol.observe("decoupled", 4, None, [0.5, 0.25])
    assert not pol.step_times and pol.acceptance == [0.5, 0.25]


def test_a_bad_profile_prompt_does_not_hold_a_good_workload_on_plain():
    """Session 14 (H200, batch 1): the warm-up profile's dummy prompt drafted badly (MAL 1.44), G started
    there, plain decoding won, and G learnt one verification per probe: half of GSM8K's batch-1 steps (MAL
    3.0) were plain. The profile's acceptance is dropped; until MIN_PRIOR_VERIFICATIONS verifications G is
    optimistic, so the workload's own drafts decide."""
    pol = _policy(execution="auto")
    times = {"plain": 1.0, "decoupled": 2.0, "parallel": 50.0}  # break-even MAL 2.1 with the margin
    dummy, _ = _request()
    for mode in pol.options:  # the profile: every mode forced, the dummy request's drafts all rejected
        pol.forced = mode
        for _ in range(WARMUP_SAMPLES + 2):
            d = pol.decide(_sched(1))
            pol.observe(d.mode, 1, times[d.mode], [0.0] * 4 if d.mode != "plain" else None)
            pol.observe_request(dummy, 0 if d.mode == "plain" else 4, 0)
    pol.finish_profile()
    seq, batch = _request()
    modes = []
    for _ in range(100):  # the workload: 3 tokens per verification
        modes.append(pol.decide(batch).mode)
        pol.observe(modes[-1], 1, times[modes[-1]], [0.9, 0.8, 0.2, 0.1] if modes[-1] != "plain" else None)
        pol.observe_request(seq, 4 if modes[-1] != "plain" else 0, 2)
    assert modes[0] == "decoupled" and pol.prior() == pytest.approx(3.0)
    assert modes.count("plain") <= 100 // REEXPLORE_EVERY * PROBE_STEPS  # only the runner-up's probes


@pytest.mark.parametrize("aging", [True, False])
def test_a_workload_shift_is_learnt_from_probes_after_a_plain_stretch(monkeypatch, aging):
    """Session 30 (H100, spec_bench): after MT-Bench (MAL ~1.95) the engine's ``auto`` ran GSM8K (MAL ~3.2) at
    batch 4 almost entirely on plain decoding (3 speculative steps of 1027; always-decoupled was 1.40x plain):
    G rested on ~PRIOR_WINDOW old verifications and each probe added a handful. G's evidence now ages over plain steps
    that verify nothing (half-life ``PRIOR_HALF_LIFE``, floor ``PRIOR_MIN_WEIGHT``), so after a plain stretch
    probes' verifications weigh against PRIOR_MIN_WEIGHT old ones and decide; without aging (the control), against
    PRIOR_WINDOW old ones, they do not."""
    if not aging:
        monkeypatch.setattr(policy_tuning, "PRIOR_KEEP", 1.0)
    pol = _policy(execution="auto")
    times = {"plain": 1.0, "decoupled": 2.0, "parallel": 50.0}  # break-even MAL ~2.2 from plain
    _train(pol, 8, times, [0.5, 0.3, 0.1, 0.05])
    old, _ = _request()
    for i in range(PRIOR_WINDOW):  # the old workload: 1.5 tokens per verification
        pol.observe_request(old, 4, i % 2)
    assert pol.prior() == pytest.approx(1.5, abs=0.02) and pol.prior_weight == PRIOR_WINDOW
    pol.observe("decoupled", 8, 2.0, None)  # a step entering speculation: drafts, nothing verified yet
    assert pol.prior_weight == PRIOR_WINDOW  # it is no plain step: G's evidence does not age
    for _ in range(4 * PRIOR_HALF_LIFE):  # a plain stretch: nothing verified
        pol.observe("plain", 8, 1.0, None)
    assert pol.prior_weight == (PRIOR_MIN_WEIGHT if aging else PRIOR_WINDOW)
    pol.observe("decoupled", 8, 2.0, [0.9, 0.8, 0.2, 0.1])  # a speculative step does not age G's evidence
    assert pol.prior_weight == (PRIOR_MIN_WEIGHT if aging else PRIOR_WINDOW)
    probes = int(1.5 * PRIOR_MIN_WEIGHT)
    for _ in range(probes):  # probes of the new workload: 1.5 x PRIOR_MIN_WEIGHT verifications of 3 tokens
        pol.observe_request(_request()[0], 4, 2)
    # requests of the new workload without evidence of their own: G decides
    batch = SchedulerOutput(scheduled=[_request()[1].scheduled[0] for _ in range(8)], preempted=[])
    if aging:
        assert pol.prior() == pytest.approx(1.5 + 1.5 * 0.6, abs=0.02)  # 3 parts new, 2 parts old
        assert pol.decide(batch).mode == "decoupled"
    else:
        assert pol.prior() < 2.0 and pol.decide(batch).mode == "plain"  # 48 new against 128 old
