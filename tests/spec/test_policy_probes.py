"""Probe back-off near a tie (``PROBE_NEAR_TIE``): a runner-up whose expected rate is close to the best keeps
being re-measured at the bucket's first interval (the cheaper a probe, the more a wrong choice costs relative to
it), while one that keeps losing clearly backs off to ``REEXPLORE_MAX``."""

from __future__ import annotations

import itertools

import pytest

from flexspec.spec import policy_tuning
from tests.spec.test_policy import _policy, _sched, _train

ACCEPTANCE = [0.5, 0.3, 0.1, 0.05]  # E = 1.95 tokens per verification


def _probe_gaps(decoupled_s: float, steps: int = 4000) -> list[int]:
    """Decisions between the starts of decoupled probes at batch 4, plain 1.0 s per step."""
    pol = _policy(execution="auto")
    times = {"plain": 1.0, "decoupled": decoupled_s, "parallel": 50.0}
    _train(pol, 4, times, ACCEPTANCE)
    modes: list[str] = []
    for _ in range(steps):
        d = pol.decide(_sched(4))
        leaving = modes and modes[-1] == "decoupled" and d.mode == "plain"  # verifies: a decoupled step
        modes.append(d.mode)
        t = times["decoupled"] if leaving else times[d.mode]
        pol.observe(d.mode, 4, t, ACCEPTANCE if d.mode != "plain" else None)
    assert modes[-50:].count("plain") == 50  # plain stays the choice: these are probes
    starts = [i for i, m in enumerate(modes) if m == "decoupled" and modes[i - 1] != "decoupled"]
    return [b - a for a, b in itertools.pairwise(starts)]


def test_a_near_tie_is_probed_at_a_constant_interval():
    # decoupled 1.95 tokens / 2.0 s against plain's 1 / 1.0 s x SPEC_MARGIN: ~0.93 of the best, a near tie
    gaps = _probe_gaps(2.0)
    assert len(gaps) >= 30 and len(set(gaps)) == 1  # PROBE_BUDGET's spacing (115 here), never doubled
    assert gaps[0] <= 2 * policy_tuning.REEXPLORE_EVERY


def test_without_the_rule_the_same_tie_backs_off(monkeypatch):
    monkeypatch.setattr(policy_tuning, "PROBE_NEAR_TIE", 2.0)  # no runner-up is ever "near"
    gaps = _probe_gaps(2.0)
    assert gaps[1:4] == [256, 512, 1024] and max(gaps) == policy_tuning.REEXPLORE_MAX


@pytest.mark.parametrize("decoupled_s", [2.1, 2.5])
def test_a_clear_loser_still_backs_off(decoupled_s):
    gaps = _probe_gaps(decoupled_s)
    assert gaps[-1] == policy_tuning.REEXPLORE_MAX and len(gaps) <= 6
