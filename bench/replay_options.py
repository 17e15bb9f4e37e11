"""The command-line values of ``bench.policy_replay`` that need more than argparse: ``--set NAME=VALUE`` overrides of
the policy's constants, ``--switch-costs`` and ``--spells``. Each raises ValueError with the option named."""

from __future__ import annotations

import math

# policy constants whose 0 is documented (PROBE_BUDGET "0 = no limit"; JOIN_EMA 0: join steps are not priced)
ZERO_MEANS_OFF = frozenset({"PROBE_BUDGET", "JOIN_EMA"})


def apply_overrides(pairs: list[str]) -> dict[str, float]:
    """Set the policy's tunable constants (``flexspec.spec.policy_tuning``, ``NAME=VALUE``); ``STALE_KEEP`` follows
    ``STALE_HALF_LIFE``, ``PRIOR_KEEP`` ``PRIOR_HALF_LIFE``. Raises ValueError for a name the module does not define."""
    from flexspec.spec import policy_tuning as policy

    done = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        if not name.isupper() or not hasattr(policy, name):
            raise ValueError(f"--set {pair!r}: flexspec.spec.policy_tuning has no constant {name!r}")
        old = getattr(policy, name)
        if name.endswith("_KEEP"):
            raise ValueError(f"--set {pair!r}: {name} follows {name[:-5]}_HALF_LIFE; set that instead")
        if isinstance(old, bool):  # switches: 0 / 1 / false / true
            if value.lower() not in ("0", "1", "false", "true"):
                raise ValueError(f"--set {pair!r}: {name} takes 0 / 1 (false / true)")
            setattr(policy, name, value.lower() in ("1", "true"))
            done[name] = getattr(policy, name)
            continue
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"--set {pair!r}: {value!r} is not a number") from None
        zero_ok = name in ZERO_MEANS_OFF
        if (
            not math.isfinite(number)
            or number < 0
            or (number == 0 and not zero_ok)
            or (isinstance(old, int) and number != int(number))
        ):
            kind = "non-negative" if zero_ok else "positive"
            raise ValueError(f"--set {pair!r}: {name} takes a {kind} {type(old).__name__}")
        setattr(policy, name, type(old)(number))
        done[name] = getattr(policy, name)
        if name == "STALE_HALF_LIFE":
            policy.STALE_KEEP = 0.5 ** (1 / policy.STALE_HALF_LIFE)
        if name == "PRIOR_HALF_LIFE":
            policy.PRIOR_KEEP = 0.5 ** (1 / policy.PRIOR_HALF_LIFE)
    return done


def parse_switch_costs(text: str) -> tuple[float, float]:
    """``--switch-costs ENTER,EXIT``: two positive multiples. Raises ValueError otherwise."""
    try:
        enter, exit_ = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--switch-costs {text!r}: expected ENTER,EXIT, two numbers") from None
    if not (enter > 0 and exit_ > 0 and math.isfinite(enter) and math.isfinite(exit_)):
        raise ValueError(f"--switch-costs {text!r}: both multiples must be positive finite numbers")
    return enter, exit_


def parse_spells(text: str) -> tuple[float, int, float]:
    try:
        rate, steps, extra_ms = text.split(",")
        out = (float(rate), int(steps), float(extra_ms) / 1e3)
    except ValueError:
        raise ValueError(f"--spells {text!r}: expected RATE,STEPS,EXTRA_MS (e.g. 0.001,8,2)") from None
    if not 0 <= out[0] <= 1 or out[1] < 0 or out[2] < 0:
        raise ValueError(f"--spells {text!r}: RATE must be in [0, 1], STEPS and EXTRA_MS at least 0")
    return out


def check_step_costs(after_exit_cost: float, ranking_cost_ms: float) -> tuple[float, float]:
    """``--after-exit-cost`` (a multiple of a plain step, >= 1) and ``--ranking-cost-ms`` (>= 0): returns
    (the multiple, the ranking cost in seconds); ValueError naming the option otherwise."""
    if not after_exit_cost >= 1.0:
        raise ValueError(f"--after-exit-cost {after_exit_cost}: must be >= 1 (a multiple of a plain step)")
    if not ranking_cost_ms >= 0.0:
        raise ValueError(f"--ranking-cost-ms {ranking_cost_ms}: must be >= 0")
    return after_exit_cost, ranking_cost_ms / 1e3
