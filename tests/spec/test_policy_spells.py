"""Slow spells (issue 6): a few consecutive steps of every mode run several times slower (host or device
hiccups; H100, session 42, batch 1: 3-17 plain steps at ~1-3.9 ms instead of 0.47, ~1 per 1,000 steps). The
policy's step-time median must outlast such a spell instead of entering speculation for STALE_AFTER decisions."""

from __future__ import annotations

from configs import EngineConfig
from flexspec.engine.scheduler import SchedulerOutput
from flexspec.spec import policy_tuning
from flexspec.spec.policy import SpeculationPolicy
from flexspec.spec.policy_tuning import STALE_AFTER, STAT_WINDOW, WARMUP_SAMPLES

ACCEPTANCE = [0.5, 0.3, 0.1, 0.05]  # E[tokens per step] 1.95: 1.95 / 2.5 s loses to plain's 1 / 1.0 s


def _sched(n: int) -> SchedulerOutput:
    return SchedulerOutput(scheduled=[object()] * n, preempted=[])  # type: ignore[list-item]


def _run(pol: SpeculationPolicy, times: dict[str, float], steps: int) -> list[str]:
    modes = []
    for _ in range(steps):
        d = pol.decide(_sched(1))
        modes.append(d.mode)
        pol.observe(d.mode, 1, times[d.mode], ACCEPTANCE if d.mode != "plain" else None)
    return modes


def _auto_policy() -> SpeculationPolicy:
    """``execution: auto`` over chains of 4 drafts (no drafter is loaded: the policy alone)."""
    spec = {"method": "dflash", "model": "unused", "num_speculative_tokens": 4, "execution": "auto"}
    return SpeculationPolicy(EngineConfig(speculative_config=spec))


def _steady_policy() -> tuple[SpeculationPolicy, dict[str, float]]:
    pol = _auto_policy()
    times = {"plain": 1.0, "decoupled": 2.5}
    _run(pol, times, (WARMUP_SAMPLES + 1) * 4 + 100)
    assert _run(pol, times, 50).count("plain") >= 45  # plain wins between probes
    return pol, times


def _spell_then_steady(pol: SpeculationPolicy, times: dict[str, float], spell_steps: int) -> list[str]:
    slow = {m: t * 4 for m, t in times.items()}  # a spell slows every mode
    while pol.decide(_sched(1)).mode != "plain" or pol.probe is not None:  # start from steady plain decoding
        pol.observe("decoupled", 1, times["decoupled"], ACCEPTANCE)
    pol.observe("plain", 1, times["plain"], None)
    return _run(pol, slow, spell_steps) + _run(pol, times, STALE_AFTER + 8)


def test_a_short_slow_spell_of_plain_steps_does_not_start_speculation():
    """A spell of 8 slow steps (fewer than half the median's window) leaves plain decoding's estimate alone:
    no stretch of speculation (probes aside, at most PROBE_VERIFICATIONS + 1 steps)."""
    pol, times = _steady_policy()
    modes = _spell_then_steady(pol, times, 8)
    assert modes.count("decoupled") <= 3, modes


def test_with_the_old_window_the_same_spell_started_a_stale_after_stretch(monkeypatch):
    """The failure the window's length fixes (session 42): with a median of 15 the same spell moved plain's
    estimate, and speculation ran until plain's estimate went stale."""
    monkeypatch.setattr(policy_tuning, "STAT_WINDOW", 15)
    pol, times = _steady_policy()
    modes = _spell_then_steady(pol, times, 8)
    assert modes.count("decoupled") >= STALE_AFTER - 4, modes


def test_a_lasting_slowdown_of_plain_decoding_is_followed():
    """A slowdown longer than half the window moves the estimate: plain at 4 s per step loses to speculation
    (1.95 / 2.5 s), and the policy switches within the window's length."""
    pol, times = _steady_policy()
    times["plain"] = 4.0
    modes = _run(pol, times, 2 * STAT_WINDOW)
    first = modes.index("decoupled")
    assert first <= STAT_WINDOW // 2 + 4, modes
    assert modes[first:].count("decoupled") >= 0.8 * (len(modes) - first)


def test_the_plain_step_after_an_exit_is_priced_with_the_exit(monkeypatch):
    """``PRICE_EXIT_FOLLOWER`` on: leaving speculation costs the exit step and the plain step after it (not
    launched ahead): the exit's recorded time is both, less one plain step, and the slow step is none of plain
    decoding's samples."""
    pol, _ = _steady_policy()
    monkeypatch.setattr(policy_tuning, "PRICE_EXIT_FOLLOWER", True)
    plain_before = pol.step_times[("plain", 1)].n
    exits = pol.step_times[("exit:decoupled", 1)]
    n = exits.n
    pol.observe("decoupled", 1, 2.5, ACCEPTANCE, previous="decoupled")
    pol.observe("plain", 1, 3.0, None, previous="decoupled")  # the exit step: recorded with the next one
    assert exits.n == n
    pol.observe("plain", 1, 2.2, None, previous="plain")  # 1.2 s over plain's 1.0
    assert exits.n == n + 1 and exits.history[-1] == 3.0 + 1.2
    assert pol.step_times[("plain", 1)].n == plain_before
    pol.observe("plain", 1, 1.0, None, previous="plain")  # steady plain again
    assert pol.step_times[("plain", 1)].n == plain_before + 1
    # an exit followed by a step where a prompt joins: the exit is recorded alone
    pol.observe("plain", 1, 3.0, None, previous="decoupled")
    pol.observe("plain", 1, 9.0, None, previous="plain", prefill=True)
    assert exits.n == n + 2 and exits.history[-1] == 3.0


def test_exit_pricing_off_records_the_exit_step_alone_and_skips_the_step_after_it():
    """``PRICE_EXIT_FOLLOWER`` off (the default since session 44's A/B): the exit step is recorded at once; the
    plain step after it (not launched ahead) is no plain sample either, the one after that is (``PROBE_STEPS``)."""
    assert not policy_tuning.PRICE_EXIT_FOLLOWER
    pol, _ = _steady_policy()
    plain_before = pol.step_times[("plain", 1)].n
    exits = pol.step_times[("exit:decoupled", 1)]
    n = exits.n
    pol.observe("decoupled", 1, 2.5, ACCEPTANCE, previous="decoupled")
    pol.observe("plain", 1, 3.0, None, previous="decoupled")
    assert exits.n == n + 1 and exits.history[-1] == 3.0
    pol.observe("plain", 1, 2.2, None, previous="plain")  # after the exit: skipped
    assert pol.step_times[("plain", 1)].n == plain_before and exits.n == n + 1
    pol.observe("plain", 1, 1.0, None, previous="plain")  # steady
    assert pol.step_times[("plain", 1)].n == plain_before + 1
    # a prompt joining the step after an exit: no plain join sample either
    joins = pol.step_times.get(("join:plain", 1))
    joins_before = joins.n if joins is not None else 0
    pol.observe("decoupled", 1, 2.5, ACCEPTANCE, previous="plain")
    pol.observe("decoupled", 1, 2.5, ACCEPTANCE, previous="decoupled")
    pol.observe("plain", 1, 3.0, None, previous="decoupled")
    pol.observe("plain", 1, 9.0, None, previous="plain", prefill=True)
    joins = pol.step_times.get(("join:plain", 1))
    assert (joins.n if joins is not None else 0) == joins_before


def test_a_plain_probe_ends_on_a_steady_plain_step():
    """A probe of plain decoding from speculation runs ``PROBE_STEPS`` (3) plain steps: the exit, the step after
    it and one steady step, whose time re-measures plain (an inflated plain estimate is corrected)."""
    assert policy_tuning.PROBE_STEPS == 3
    pol = _auto_policy()
    good = [
        0.5,
        0.35,
        0.2,
        0.15,
    ]  # MAL 2.2: decoupled 2.2 / 2.5 s beats plain's 1 / 1.9 s, not its true 1 / 1.0
    slow_plain = {"plain": 1.9, "decoupled": 2.5}  # plain timed in a slow spell at warm-up
    for _ in range(200):
        d = pol.decide(_sched(1))
        pol.observe(d.mode, 1, slow_plain[d.mode], good if d.mode != "plain" else None)
    assert pol.step_time("plain", 1) == 1.9
    assert pol.decide(_sched(1)).mode == "decoupled"
    pol.observe("decoupled", 1, 2.5, good)
    steps, probes = ["decoupled", "decoupled"], 0
    for _ in range(3000):
        d = pol.decide(_sched(1))
        # plain's steady steps take 1.0 s; the exit and the step after it (not launched ahead) 1.9
        t = 2.5 if d.mode != "plain" else (1.9 if "decoupled" in steps[-2:] else 1.0)
        steps.append(d.mode)
        probes += d.reason == "probe" and d.mode == "plain"
        pol.observe(d.mode, 1, t, good if d.mode != "plain" else None)
    assert probes >= 3  # a probe of plain
    assert pol.step_time("plain", 1) == 1.0  # re-measured by a probe's steady step
    assert steps[-500:].count("plain") > 450  # and plain decoding chosen from then on


def test_plain_is_probed_however_far_below_the_best_its_estimate_is(monkeypatch):
    """``ALWAYS_PROBE_PLAIN``: a plain estimate 4x too slow puts plain under ``PROBE_WITHIN`` of the best, where
    other options are never re-measured; plain still is, and its steady steps correct it. Off, it stays locked
    out (session 44's H100 log: a warm-up profile's plain@64 at 2.40 ms against 1.14 elsewhere)."""

    def run(always: bool) -> tuple[float, list[str]]:
        monkeypatch.setattr(policy_tuning, "ALWAYS_PROBE_PLAIN", always)
        pol = _auto_policy()
        good = [0.5, 0.35, 0.2, 0.15]  # MAL 2.2 at 2.5 s: 0.88 tokens / s against plain's true 1.0
        for _ in range(200):  # warm-up with plain timed 4x too slow
            d = pol.decide(_sched(1))
            pol.observe(d.mode, 1, 4.0 if d.mode == "plain" else 2.5, good if d.mode != "plain" else None)
        steps = ["decoupled", "decoupled"]
        for _ in range(4000):
            d = pol.decide(_sched(1))
            t = 2.5 if d.mode != "plain" else (4.0 if "decoupled" in steps[-2:] else 1.0)
            steps.append(d.mode)
            pol.observe(d.mode, 1, t, good if d.mode != "plain" else None)
        return pol.step_time("plain", 1), steps

    t_on, steps_on = run(True)
    assert t_on == 1.0 and steps_on[-500:].count("plain") > 450
    t_off, steps_off = run(False)
    assert t_off == 4.0 and steps_off[-500:].count("plain") < 50
