"""The policy's switch steps (issue 6): the steps entering and leaving speculation are timed per mode and bucket
(``SpeculationPolicy.switch_time``) and price a round trip and a probe (``flexspec.spec.switch_costs``)."""

from __future__ import annotations

import pytest

from flexspec.spec.policy import entry_factor
from flexspec.spec.policy_tuning import (
    MIN_PRIOR_VERIFICATIONS,
    SPEC_MARGIN,
    SWITCH_HORIZON,
    SWITCH_MAX,
    WARMUP_SAMPLES,
)
from flexspec.spec.switch_costs import probe_time_lost
from tests.spec.test_policy import _policy, _run, _sched, _train


def test_measured_switch_steps_price_a_round_trip():
    """Session 30 (H100, b=64): the step entering speculation took 3.7-5.0 ms and the one leaving it 3.2-3.8 ms
    against 2.6-2.8 ms for a steady speculative step. Once both are timed, a round trip of SWITCH_HORIZON (H)
    speculative steps is priced with them: (1 + H m) t_s / (m (t_e + (H - 1) t_s + t_x)) of the steady rate;
    before, as a draftless steady step (entry_factor). Here MAL 2.3 enters speculation at steady-state prices
    and no longer does with slow switch steps; a batch already speculating stays (leaving pays the same)."""
    pol = _policy(execution="auto")
    _train(pol, 64, {"plain": 1.0, "decoupled": 2.0, "parallel": 50.0}, [0.5, 0.3, 0.1, 0.05])
    for key in [k for k in pol.step_times if ":" in k[0]]:  # the training's switch steps cost steady ones
        del pol.step_times[key]
    pol.prior_tokens_per_step, pol.num_verifications = 2.3, MIN_PRIOR_VERIFICATIONS
    assert pol.round_trip_factor("decoupled", 64, 2.3) == entry_factor(2.3)  # not measured yet
    pol.last_modes = ["plain"]
    assert pol.decide(_sched(64)).mode == "decoupled"  # 2.3 / 2.0 x 0.965 > 1.0 x SPEC_MARGIN
    for _ in range(WARMUP_SAMPLES):
        pol.observe("decoupled", 64, 3.5, [0.5, 0.3], previous="plain")
        pol.observe("plain", 64, 3.0, None, previous="decoupled")
    pol.prior_tokens_per_step = 2.3
    assert (
        pol.switch_time("enter", "decoupled", 64) == 3.5 and pol.switch_time("exit", "decoupled", 32) == 3.0
    )
    est = pol.estimates_ms()  # what spec_bench records as policy_step_ms
    assert est["enter:decoupled@64"] == 3500.0 and est["exit:decoupled@64"] == 3000.0
    assert est["plain@64"] == 1000.0 and est["decoupled@64"] == 2000.0
    h, m = SWITCH_HORIZON, 2.3
    factor = (1 + h * m) * 2.0 / (m * (3.5 + (h - 1) * 2.0 + 3.0))
    assert pol.round_trip_factor("decoupled", 64, m) == pytest.approx(factor)
    assert 2.3 / 2.0 * factor < 1.0 * SPEC_MARGIN < 2.3 / 2.0 * entry_factor(2.3)
    pol.last_modes = ["plain"]
    assert pol.decide(_sched(64)).mode == "plain"
    pol.last_modes = ["decoupled"]
    assert pol.decide(_sched(64)).mode == "decoupled"


def test_switch_step_prices_are_bounded():
    """A switch step is priced at most SWITCH_MAX steady steps, so one slow sample (the warm-up profile leaves
    one per bucket; a first-time compile) cannot price speculation out of a bucket for good: a new sample comes
    only from a switch. And a measured round trip never keeps more than entry_factor: cheap switch steps do not
    make leaving and re-entering pay (flip-flops near break-even)."""
    pol = _policy(execution="auto")
    _train(pol, 4, {"plain": 1.0, "decoupled": 1.5, "parallel": 50.0}, [0.5, 0.3, 0.1, 0.05])
    for key in [k for k in pol.step_times if ":" in k[0]]:
        del pol.step_times[key]
    pol.observe("decoupled", 4, 50.0, [0.5], previous="plain")  # a one-off: 33 steady steps
    pol.observe("plain", 4, 1.6, None, previous="decoupled")
    pol.observe("plain", 4, 1.0, None, previous="plain")  # an exit is recorded with the next step (+0 here)
    m = 2.0
    capped = (1 + SWITCH_HORIZON * m) * 1.5 / (m * (SWITCH_MAX * 1.5 + (SWITCH_HORIZON - 1) * 1.5 + 1.6))
    assert pol.round_trip_factor("decoupled", 4, m) == pytest.approx(capped) and capped > 0.8
    pol.prior_tokens_per_step, pol.num_verifications = m, MIN_PRIOR_VERIFICATIONS  # decoupled: 1.33x plain
    modes = _run(pol, {"plain": 1.0, "decoupled": 1.5, "parallel": 50.0}, [0.5, 0.3, 0.2], 300, n=4)
    assert modes.count("decoupled") > 250  # entered (the one-off alone said 0.33 of the steady rate: never)
    assert (
        pol.switch_time("enter", "decoupled", 4) < 50.0
    )  # and re-measured: the minimum of the first samples
    # cheap switch steps: the measured share would exceed 1; it is held at entry_factor
    for _ in range(WARMUP_SAMPLES):
        pol.observe("decoupled", 4, 0.5, [0.5], previous="plain")
        pol.observe("plain", 4, 0.5, None, previous="decoupled")
    pol.observe("plain", 4, 0.5, None, previous="plain")
    assert pol.round_trip_factor("decoupled", 4, m) == entry_factor(m)
    # ... and a probe's switch steps are priced as steady ones (clamp_switch), not as free
    for best, runner_up in (("plain", "decoupled"), ("decoupled", "plain")):
        t_b, t_r = (1.0, 2.5) if best == "plain" else (1.5, 1.0)  # the runner-up loses
        t_s = t_r if best == "plain" else t_b
        cheap = probe_time_lost(best, runner_up, t_b, t_r, m, 0.5, 0.5)
        assert cheap == probe_time_lost(best, runner_up, t_b, t_r, m, t_s, t_s) > 0
