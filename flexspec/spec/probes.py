"""Which option a due probe of the speculation policy re-measures, and how far apart its probes must be
(:mod:`flexspec.spec.policy`, whose module doc says when probes come and why). A mixin of
:class:`~flexspec.spec.policy.SpeculationPolicy`: it reads the policy's step-time estimates."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flexspec.spec import policy_tuning as tuning
from flexspec.spec.switch_costs import probe_time_lost


class ProbeChoice:
    """The policy's probe target and probe spacing (part of ``SpeculationPolicy``)."""

    # provided by SpeculationPolicy
    step_times: dict[tuple[str, int], Any]

    if TYPE_CHECKING:

        def step_time(self, mode: str, bucket: int) -> float | None: ...

        def switch_time(self, kind: str, mode: str, bucket: int) -> float | None: ...

    def _probe_target(self, ranked: list[str], rates: dict[str, float], bucket: int) -> str | None:
        """The option a due probe re-measures: of those (but the best) whose expected rate is within
        ``PROBE_WITHIN`` of the best, the one whose step time at ``bucket`` was measured longest ago (first in
        rank on ties), so probes cycle through the plausible options; with two options, the runner-up. Probing
        the runner-up only left a third option's estimate as the warm-up profile set it (replay over session
        36's H100 times: GSM8K b=64 ran full-length chains, 0.90 of the chains of 3 drafts it never re-measured)."""
        floor = tuning.PROBE_WITHIN * rates[ranked[0]]
        plausible = [
            m for m in ranked[1:] if rates[m] >= floor or (m == "plain" and tuning.ALWAYS_PROBE_PLAIN)
        ]
        if not plausible:
            return None

        def measured_at(mode: str) -> int:
            stat = self.step_times.get((mode, bucket))
            return stat.recorded_at if stat is not None and stat.n else -1

        return min(plausible, key=measured_at)

    def _probe_gap(self, best: str, runner_up: str, bucket: int, tokens: dict[str, float]) -> float:
        """Decisions since the bucket's last probe before the runner-up may be probed again, so that probes
        cost at most ``PROBE_BUDGET`` of the best mode's throughput: the time a probe loses
        (``switch_costs.probe_time_lost``, with the switch steps once measured) over the gap's g steps of the
        best mode (g t_b) must stay within the budget. H100, b=64 (session 29): plain 1.13 ms, decoupled DFlash
        3.25 ms per step; at MT-Bench's MAL 1.95 a probe every 64 decisions cost ~5.8% of the bucket's
        throughput (now >= 373 decisions apart), at GSM8K's 3.24 ~1.8% (>= 115 apart)."""
        t_b, t_r = self.step_time(best, bucket), self.step_time(runner_up, bucket)
        if tuning.PROBE_BUDGET <= 0 or not t_b or not t_r:
            return 0.0
        spec = best if runner_up == "plain" else runner_up
        t_e, t_x = self.switch_time("enter", spec, bucket), self.switch_time("exit", spec, bucket)
        lost = probe_time_lost(best, runner_up, t_b, t_r, tokens[spec], t_e, t_x)
        return lost / (tuning.PROBE_BUDGET * t_b)
