"""Step logs carry what the policy saw (``StepRecord.rates`` / ``spec_tokens`` / ``est_ms``) on the steps where
it ranked its options, so a device run shows why ``auto`` chose speculation (e.g. session 42's b=1 stretches).
While the step runs the record only references the policy's objects (``ranking``); they are converted after it."""

from __future__ import annotations

from types import SimpleNamespace

from bench.engine_load import StepRecord, StepTimers
from tests.spec.test_policy import _policy, _sched, _train


def _input(n: int) -> SimpleNamespace:
    return SimpleNamespace(
        query_lens=[1] * n, num_draft_tokens=[0] * n, samples=[True] * n, num_tokens=n, spec_mode="plain"
    )


def test_ranked_decisions_log_rates_tokens_and_step_estimates():
    pol = _policy()
    engine = SimpleNamespace(executor=SimpleNamespace(execute=lambda inp: None), policy=pol)
    timers = StepTimers(engine)
    d = pol.decide(_sched(4))  # the first decision of a fresh policy: warm-up, nothing ranked
    timers.current = rec = StepRecord()
    timers._describe(_input(4))
    rec.describe_ranking()
    assert d.reason == "warmup" and rec.reason == "warmup" and rec.rates is None and rec.est_ms is None
    times = {"plain": 0.001, "decoupled": 0.0015, "parallel": 0.0012}  # seconds per step
    _train(pol, 4, times, [0.9, 0.8, 0.7, 0.6])  # E[tokens per step] = 4.0
    d = pol.decide(_sched(4))
    timers.current = rec = StepRecord()
    timers._describe(_input(4))
    assert rec.ranking is not None and rec.rates is None  # nothing computed inside the timed step
    rec.describe_ranking()
    assert (d.mode, rec.reason, rec.mode) == ("parallel", "best", "parallel")
    assert set(rec.rates) == {"plain", "decoupled", "parallel"} and rec.spec_tokens == 4.0
    assert rec.est_ms == {"plain": 1.0, "decoupled": 1.5, "parallel": 1.2}
    assert max(rec.rates, key=rec.rates.get) == "parallel" and rec.rates["parallel"] > rec.rates["plain"]
