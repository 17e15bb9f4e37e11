"""The host time of the policy's decisions (it sits on every step; a b=64 step is host-bound on an H100 host, and
a b=1 plain step is ~0.45 ms). Held decisions (``policy_tuning.HOLD_STEPS``): a decision whose best option leads
the runner-up by ``HOLD_MARGIN`` (plain decoding at any batch size, a speculative mode from ``HOLD_FROM``
sequences on) is reused for the batch's next ``HOLD_STEPS - 1`` decisions without ranking the options again, but
never past a due probe, nor when a prompt joins or the batch size changes. A ranking looks each step time up
once (``SpeculationPolicy.step_time``'s memo), which changes no decision."""

from __future__ import annotations

import itertools

import pytest

from flexspec.engine.scheduler import SchedulerOutput
from flexspec.spec import policy_tuning
from flexspec.spec.policy import SpeculationPolicy
from tests.spec.test_policy_spells import _auto_policy

ACCEPTANCE = [0.5, 0.3, 0.1, 0.05]  # E[tokens per step] 1.95


def _sched(n: int, prefills: int = 0) -> SchedulerOutput:
    return SchedulerOutput(scheduled=[object()] * n, preempted=[], num_prefills=prefills)  # type: ignore[list-item]


def _run(pol: SpeculationPolicy, times: dict[str, float], steps: int, n: int, joins: int = 0) -> list[str]:
    """``steps`` decisions at batch size ``n`` with steady step times (a prompt joins every ``joins``-th step);
    returns each decision's option and reason."""
    out = []
    for i in range(steps):
        d = pol.decide(_sched(n, prefills=int(joins > 0 and i % joins == 0)))
        out.append(f"{d.option}:{d.reason}")
        pol.observe(d.option, n, times[d.mode], ACCEPTANCE if d.mode != "plain" else None)
    return out


@pytest.mark.parametrize(
    ("n", "times"),
    [
        (32, {"plain": 1.0, "decoupled": 2.5}),
        (32, {"plain": 1.0, "decoupled": 1.2}),
        (1, {"plain": 1.0, "decoupled": 2.5}),
    ],
    ids=["plain", "speculation", "plain at b=1"],
)
def test_held_decisions_equal_ranked_ones_and_probes_come_on_time(monkeypatch, n, times):
    """With steady step times and acceptance, holding changes no decision, probes included (at the same
    steps), while the options are ranked far less often: plain decisively best (1.95 tokens / 2.5 s), then
    speculation decisively best (1.95 / 1.2 s)."""
    held, ranked = _auto_policy(), _auto_policy()
    decisions = _run(held, times, 800, n)
    monkeypatch.setattr(policy_tuning, "HOLD_STEPS", 1)
    assert _run(ranked, times, 800, n) == decisions
    assert sum(d.endswith(":probe") for d in decisions) >= 3  # probes came, at the same steps
    assert held.num_rankings < ranked.num_rankings / 4, (held.num_rankings, ranked.num_rankings)


def test_a_joining_prompt_or_another_batch_size_ranks_again(monkeypatch):
    monkeypatch.setattr(policy_tuning, "HOLD_PLAIN_ACROSS_JOINS", False)
    pol = _auto_policy()
    times = {"plain": 1.0, "decoupled": 2.5}
    _run(pol, times, 200, 32)
    while pol.probe is not None or pol.last_modes[-1] != "plain":
        _run(pol, times, 1, 32)
    counts = []
    for n, joins in [(32, 1), (32, 0), (31, 0), (31, 0), (31, 1), (31, 0)]:
        pol.decide(_sched(n, prefills=joins))
        pol.observe("plain", n, 1.0, None)
        counts.append(pol.num_rankings)
    # ranked: a prompt joins, the batch size changes, a prompt joins; held: the same batch again
    assert [b - a for a, b in zip([counts[0] - 1, *counts], counts)] == [1, 0, 1, 0, 1, 0]


def test_held_plain_decisions_hold_across_joins_within_the_bucket_when_asked(monkeypatch):
    """``HOLD_PLAIN_ACROSS_JOINS``: a held plain decision is reused when prompts join and while the batch size stays
    in its bucket (31 and 32: bucket 32); another bucket (16) ranks again. The flag off: see the test above."""
    monkeypatch.setattr(policy_tuning, "HOLD_PLAIN_ACROSS_JOINS", True)
    pol = _auto_policy()
    times = {"plain": 1.0, "decoupled": 2.5}
    _run(pol, times, 200, 32)
    ranked_last = False  # until a ranking has just chosen plain and set a fresh hold (7 more decisions)
    while not ranked_last or pol.probe is not None or pol.last_modes[-1] != "plain" or pol._held is None:
        before = pol.num_rankings
        _run(pol, times, 1, 32)
        ranked_last = pol.num_rankings > before
    counts = [pol.num_rankings]
    for n, joins in [(32, 1), (32, 0), (31, 1), (31, 0), (16, 1), (16, 0)]:
        assert pol.decide(_sched(n, prefills=joins)).option == "plain"
        pol.observe("plain", n, 1.0, None)
        counts.append(pol.num_rankings)
    assert [b - a for a, b in itertools.pairwise(counts)] == [0, 0, 0, 0, 1, 0]


@pytest.mark.parametrize(
    ("n", "times"),
    [(8, {"plain": 1.0, "decoupled": 1.2}), (32, {"plain": 1.0, "decoupled": 1.95 / 1.05})],
    ids=["speculation below HOLD_FROM", "near tie"],
)
def test_small_batches_speculating_and_near_ties_rank_every_step(n, times):
    pol = _auto_policy()
    decisions = _run(pol, times, 300, n)
    warmup = sum(d.endswith(":warmup") for d in decisions)
    assert pol.num_rankings == len(decisions) - warmup


def test_memoized_step_times_change_no_decision(monkeypatch):
    """Rankings with step_time's memo equal rankings that compute every lookup afresh, over switches, probes and
    warm-up, at a batch size where nothing is held; the memo is gone once the decision is made."""
    times = {"plain": 1.0, "decoupled": 1.8}
    memo = _auto_policy()
    decisions = _run(memo, times, 600, 4)
    assert memo._memo is None
    lookups = []

    def fresh(self, mode, bucket):
        lookups.append(self._memo)
        return SpeculationPolicy._step_time(self, mode, bucket)

    monkeypatch.setattr(SpeculationPolicy, "step_time", fresh)
    plain = _auto_policy()
    assert _run(plain, times, 600, 4) == decisions
    assert len({d.split(":")[0] for d in decisions}) >= 2 and any(d.endswith(":probe") for d in decisions)
    assert any(m is not None for m in lookups)  # the memo was active while ranking
