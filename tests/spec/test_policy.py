"""The per-batch execution policy (issue 6): measured step times and acceptance decide the mode."""

from __future__ import annotations

import pytest

from configs import EngineConfig
from flexspec.engine.scheduler import SchedulerOutput
from flexspec.spec.policy import WARMUP_SAMPLES, SpeculationPolicy


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
    assert {m for (m, _) in pol.step_times} == {"plain", "decoupled", "parallel"}
    assert pol.decide(_sched(1)).mode == "parallel"  # 4.0 / 1.2 beats 4.0 / 1.5 and 1 / 1.0


def test_large_batch_where_speculation_does_not_pay_falls_back_to_plain():
    pol = _policy()
    _train(pol, 64, {"plain": 1.0, "decoupled": 2.5, "parallel": 9.0}, [0.5, 0.3, 0.1, 0.05])  # E = 1.95
    d = pol.decide(_sched(64))
    assert d.mode == "plain" and d.num_speculative_tokens == 0


def test_buckets_are_independent_and_runner_up_is_remeasured():
    pol = _policy()
    _train(pol, 1, {"plain": 1.0, "decoupled": 1.35, "parallel": 1.2}, [0.9, 0.8, 0.7, 0.6])
    modes = [pol.decide(_sched(1)).mode for _ in range(200)]
    assert modes.count("parallel") > 180 and "decoupled" in modes  # periodic re-exploration (plausible)
    assert "plain" not in modes  # 1 token / 1.0 s is far below 4 / 1.2: never re-measured
    assert pol.decide(_sched(33)).mode in {"plain", "decoupled", "parallel"}  # new bucket: warm-up again


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
    """A step after a mode switch verifies the previous mode's drafts: its time belongs to neither mode."""
    pol = _policy(execution="auto")
    seen = []
    for _ in range((WARMUP_SAMPLES + 1) * 3):
        d = pol.decide(_sched(2))
        switch = len(seen) > 0 and seen[-1] != d.mode
        seen.append(d.mode)
        pol.observe(d.mode, 2, 100.0 if switch else 1.0, None)  # switch steps are slow outliers
    assert {m for (m, _) in pol.step_times} == {"plain", "decoupled", "parallel"}
    assert all(st.seconds == 1.0 for st in pol.step_times.values())


def test_a_pessimistic_estimate_is_probed_again():
    """Decoupled looked bad once (0.6 of plain): it is still re-measured, for PROBE_STEPS steps in a row, and
    wins once its real time shows."""
    pol = _policy(execution="auto")
    times = {"plain": 1.0, "decoupled": 3.0, "parallel": 50.0}
    _train(pol, 4, times, [0.5, 0.3, 0.1, 0.05])  # decoupled: 1.95 / 3.0 = 0.65 of plain
    times["decoupled"] = 1.2  # the real steady-state cost: 1.95 / 1.2 beats plain
    modes = []
    for _ in range(400):
        d = pol.decide(_sched(4))
        modes.append(d.mode)
        pol.observe(d.mode, 4, times[d.mode], [0.5, 0.3, 0.1, 0.05] if d.mode != "plain" else None)
    first = modes.index("decoupled")
    assert modes[first + 1] == "decoupled"  # a probe is two steps: the first is a switch step
    assert modes[-100:].count("decoupled") > 90
    assert "parallel" not in modes  # 50x slower: never probed
