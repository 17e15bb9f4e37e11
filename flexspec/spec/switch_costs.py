"""What switching between plain decoding and a speculative mode costs the speculation policy
(:mod:`flexspec.spec.policy`): the share of a speculative stretch's steady-state rate that survives its switch
steps, and the time a probe of the runner-up mode loses. Pure functions of step times (seconds) and tokens per
step; the policy supplies its measured estimates."""

from __future__ import annotations

from flexspec.spec import policy_tuning as tuning


def entry_factor(tokens_per_step: float) -> float:
    """Share of a speculative mode's steady-state rate left when it is entered from plain decoding: over
    ``SWITCH_HORIZON`` (H) steps at ``tokens_per_step`` (m) tokens each, the first emits 1 (no drafts to verify
    yet): (H m - (m - 1)) / (H m)."""
    m = max(tokens_per_step, 1.0)
    return 1.0 - (m - 1.0) / (tuning.SWITCH_HORIZON * m)


def round_trip_share(
    tokens_per_step: float, t_steady: float | None, t_enter: float | None, t_exit: float | None
) -> float:
    """Share of a speculative mode's steady-state rate left over a stretch of ``SWITCH_HORIZON`` (H) steps
    entered from plain decoding and left again. With both switch steps measured: the entering step (``t_enter``)
    emits 1 token, H - 1 steady steps (``t_steady``) m each, the leaving step (``t_exit``) verifies the last
    drafts and emits m, so the stretch runs at (1 + H m) / (t_e + (H - 1) t_s + t_x) against m / t_s.
    Otherwise ``entry_factor`` (the entering step priced as a steady one). Session 30, H100, b=64: entering
    steps took 3.7-5.0 ms and leaving ones 3.2-3.8 ms against 2.6-2.8 ms steady (the drafter catches up on the
    context the plain steps left; the leaving step's tail), which the steady-state price did not see."""
    m = max(tokens_per_step, 1.0)
    if not t_steady or t_enter is None or t_exit is None:
        return entry_factor(m)
    h = tuning.SWITCH_HORIZON
    return (1.0 + h * m) * t_steady / (m * (t_enter + (h - 1) * t_steady + t_exit))


def probe_time_lost(
    best: str,
    runner_up: str,
    t_best: float,
    t_runner_up: float,
    tokens_per_step: float,
    t_enter: float | None = None,
    t_exit: float | None = None,
) -> float:
    """Seconds a probe of ``runner_up`` loses against staying on ``best`` (each "plain" or a speculative mode;
    ``tokens_per_step`` = m, a speculative step's expected tokens): the probe's time less the time ``best``
    would take to emit what the probe emits. With steady-state prices, a probe of P steps of the runner-up
    (time P t_r) emits: a speculative probe from plain decoding 1 + (P - 1) m (its first step has no drafts
    to verify; from another speculative mode P m), a plain probe P tokens. With both switch steps between plain
    decoding and the speculative mode measured (``t_enter``, ``t_exit``): a speculative probe is its entering
    step (1 token), ``PROBE_VERIFICATIONS`` verifying steps and the leaving step that verifies the last drafts (m
    tokens); a plain probe is the leaving step (m tokens), ``PROBE_STEPS`` - 1 plain steps and the step entering
    speculation again (1 token). Session 30, H100, MT-Bench b=64: a probe lost ~6.6 ms where the steady-state
    prices said ~2 ms."""
    m = max(tokens_per_step, 1.0)
    m_best = 1.0 if best == "plain" else m
    if "plain" not in (best, runner_up) or t_enter is None or t_exit is None:  # steady-state prices
        if runner_up == "plain":
            steps, emitted = tuning.PROBE_STEPS, float(tuning.PROBE_STEPS)
        else:
            steps = 1 + tuning.PROBE_VERIFICATIONS
            first = 1.0 if best == "plain" else m  # entered from plain: no drafts to verify yet
            emitted = first + tuning.PROBE_VERIFICATIONS * m
        spent = steps * t_runner_up
    elif runner_up == "plain":  # leave (verifies the last drafts), plain steps, enter again (1 token)
        spent = t_exit + (tuning.PROBE_STEPS - 1) * t_runner_up + t_enter
        emitted = m + tuning.PROBE_STEPS
    else:  # enter (1 token), the verifying steps, leave (verifies the last drafts: m tokens)
        spent = t_enter + tuning.PROBE_VERIFICATIONS * t_runner_up + t_exit
        emitted = 1.0 + (tuning.PROBE_VERIFICATIONS + 1) * m
    return max(spent - emitted * t_best / m_best, 0.0)
