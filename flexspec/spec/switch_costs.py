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


def clamp_switch(t_switch: float, t_steady: float) -> float:
    """A switch step's price: its measured time within [1, ``SWITCH_MAX``] steady steps of the speculative mode
    (cheaper ones would reward flipping between the modes, dearer ones let one slow sample lock a mode out)."""
    return min(max(t_switch, t_steady), tuning.SWITCH_MAX * t_steady)


def round_trip_share(
    tokens_per_step: float, t_steady: float | None, t_enter: float | None, t_exit: float | None
) -> float:
    """Share of a speculative mode's steady-state rate left over a stretch of ``SWITCH_HORIZON`` (H) steps
    entered from plain decoding and left again. With both switch steps measured: the entering step (``t_enter``)
    emits 1 token, H - 1 steady steps (``t_steady``) m each, the leaving step (``t_exit``) verifies the last
    drafts and emits m, so the stretch runs at (1 + H m) / (t_e + (H - 1) t_s + t_x) against m / t_s.
    Otherwise ``entry_factor`` (the entering step priced as a steady one), which is also the most a measured
    round trip keeps: cheap switch steps must not take away the hysteresis that stops near-break-even batches
    flipping between the modes (each flip loses a draftless step and the plain steps' launch ahead; with switch
    steps as cheap as this CPU's at b=2-4 the uncapped share exceeded 1 and a replay flipped on every step). Each
    switch step is priced at most ``SWITCH_MAX`` steady steps, so that one slow sample (a first-time compile, a
    host hiccup; the warm-up profile leaves one per bucket) cannot price speculation out of a bucket for good:
    a new sample comes only from a switch, and a mode priced far below the best is not even probed.
    Session 30's H100 step logs (``bench.step_log_report``, per bucket, p50, few samples each): with that
    session's final code entering steps cost 0.89-1.27 and leaving ones 0.96-1.24 steady speculative steps at
    b=16-64; before its cheaper entry, entering ones up to 4.5 at b=64; at b=1-4 (its earlier runs) entering
    0.53-1.28, leaving 1.8-2.6."""
    m = max(tokens_per_step, 1.0)
    if not t_steady or t_enter is None or t_exit is None:
        return entry_factor(m)
    h, t_e, t_x = tuning.SWITCH_HORIZON, clamp_switch(t_enter, t_steady), clamp_switch(t_exit, t_steady)
    return min((1.0 + h * m) * t_steady / (m * (t_e + (h - 1) * t_steady + t_x)), entry_factor(m))


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
    speculation again (1 token). Switch steps are priced by ``clamp_switch``, as in ``round_trip_share``."""
    m = max(tokens_per_step, 1.0)
    m_best = 1.0 if best == "plain" else m
    if t_enter is not None and t_exit is not None:
        t_spec = t_best if runner_up == "plain" else t_runner_up  # the speculative mode's steady step
        t_enter, t_exit = clamp_switch(t_enter, t_spec), clamp_switch(t_exit, t_spec)
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
