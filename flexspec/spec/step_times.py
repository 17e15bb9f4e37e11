"""Step times the speculation policy measures per (mode, batch-size bucket) (:mod:`flexspec.spec.policy`): the
bucketing of batch sizes and the robust statistic behind each estimate."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from flexspec.spec import policy_tuning as tuning


def batch_bucket(num_seqs: int) -> int:
    """Batch sizes grouped by powers of two: 1, 2, 4, 8, ..."""
    b = 1
    while b < num_seqs:
        b *= 2
    return b


def median(xs) -> float:
    """``statistics.median`` of a non-empty sequence, without its type checks (called after every step)."""
    v = sorted(xs)
    m = len(v) // 2
    return v[m] if len(v) % 2 else (v[m - 1] + v[m]) / 2


@dataclass
class StepTimeStat:
    """Step times of one (mode, bucket): the minimum of the first ``WARMUP_SAMPLES`` (one-off costs such as a
    kernel's first compile must not set the estimate), then the median of the last ``STAT_WINDOW`` (a stray
    slow step - a GC pause, a host hiccup - must not move it: with a moving average one 20 ms outlier locked a
    mode out for hundreds of steps on the H200)."""

    n: int = 0
    seconds: float = 0.0
    window: deque = field(default_factory=lambda: deque(maxlen=tuning.STAT_WINDOW))
    history: deque = field(default_factory=lambda: deque(maxlen=tuning.LONG_WINDOW))
    recorded_at: int = 0  # the policy's decision count at the latest sample
    _long_run: float | None = None  # median of ``history``, computed when first asked after a sample

    def add(self, t: float, now: int = 0) -> None:
        """One step time (seconds) at decision count ``now``; the first after ``STALE_AFTER`` decisions without
        one starts a new window (a run of the mode after a break is measured afresh)."""
        if now - self.recorded_at > tuning.STALE_AFTER:
            self.window.clear()
        self.window.append(t)
        self.history.append(t)
        self.n += 1
        self.recorded_at = now
        self._long_run = None
        self.seconds = min(self.window) if self.n < tuning.WARMUP_SAMPLES else median(self.window)

    def long_run(self) -> float:
        """Median of the last ``LONG_WINDOW`` samples (cached: a stale estimate is asked for every decision
        while no sample arrives)."""
        if self._long_run is None:
            self._long_run = median(self.history)
        return self._long_run
