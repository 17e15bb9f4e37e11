"""Per-batch execution choice, made once by the engine and sent to every TP rank inside ModelInput.

Ranks that disagreed on whether or how to draft would deadlock in collectives (a known vLLM hang), so no
rank ever decides on its own. Each step the policy picks how to draft for the next step:

* ``plain``     — no drafts (plain decoding),
* ``decoupled`` — verify, then draft in a separate (small) forward,
* ``parallel``  — draft inside the verification forward (FlexDraft only: O(B^2) extra tokens per sequence).

With ``execution: auto`` it maximises expected emitted tokens per second = E[tokens per step] / step time,
where E[tokens per step] is the mean over the batch's requests of each request's running MAL (requests that
have not been verified yet use 1 + sum_i per-position acceptance i of all requests), and step times are
measured online per (mode, batch-size bucket):

* warm-up: each option is measured ``WARMUP_SAMPLES`` times, at whatever batch size comes first;
* a bucket not measured yet for a mode borrows the nearest measured bucket's time, scaled by how plain
  decoding's time changes between the two buckets; so a new batch size does not re-measure every option:
  only options whose estimate is within ``PLAUSIBLE`` of the best are measured there (the best one is
  simply used, which measures it);
* the runner-up is re-measured (``PROBE_STEPS`` consecutive steps) every ``REEXPLORE_EVERY`` decisions of a
  bucket if its estimate is within ``PROBE_WITHIN`` of the best, so an estimate made under unlucky conditions
  (or stale acceptance statistics: requests that never draft never update them) does not lock a mode out.

A step's wall time covers verifying the drafts decided one step earlier plus drafting for the decision made
now, so only steps whose decision equals the previous one are recorded (steady state of one mode); a mode
switch costs one unrecorded step.

The first samples of a (mode, bucket) keep their minimum (one-off costs such as a kernel's first compile
must not set the estimate), later ones an exponential moving average. ``disable_by_batch_size`` (vLLM)
forces plain decoding above a batch size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from configs.engine import EngineConfig
from flexspec.engine.scheduler import SchedulerOutput

WARMUP_SAMPLES = 3  # measurements per (mode, bucket) before the policy trusts it
REEXPLORE_EVERY = 64  # decisions per bucket between re-measurements of the runner-up
PROBE_STEPS = 2  # consecutive steps of a re-measurement (the first is a switch step, not recorded)
PLAUSIBLE = 0.85  # options whose expected rate is at least this share of the best are worth measuring
PROBE_WITHIN = 0.5  # the runner-up is re-measured while its estimate is at least this share of the best
EMA = 0.2


def batch_bucket(num_seqs: int) -> int:
    """Batch sizes grouped by powers of two: 1, 2, 4, 8, ..."""
    b = 1
    while b < num_seqs:
        b *= 2
    return b


@dataclass
class _Stat:
    n: int = 0
    seconds: float = 0.0  # EMA of step time

    def add(self, t: float) -> None:
        if self.n == 0:
            self.seconds = t
        elif self.n < WARMUP_SAMPLES:
            self.seconds = min(self.seconds, t)
        else:
            self.seconds = (1 - EMA) * self.seconds + EMA * t
        self.n += 1


@dataclass
class Decision:
    mode: str  # "plain" | "decoupled" | "parallel"
    num_speculative_tokens: int


@dataclass
class SpeculationPolicy:
    config: EngineConfig
    step_times: dict[tuple[str, int], _Stat] = field(default_factory=dict)
    decisions: dict[int, int] = field(default_factory=dict)  # bucket -> count
    mode_counts: dict[str, int] = field(default_factory=dict)
    acceptance: list[float] = field(default_factory=list)  # per-position acceptance (EMA over steps)
    last_modes: list[str] = field(default_factory=list)  # the last two decisions (steady-state attribution)
    probe: tuple[str, int] | None = None  # (mode, decisions left) of a running re-measurement

    def __post_init__(self) -> None:
        spec = self.config.speculative_config
        assert spec is not None
        self.spec = spec
        if spec.execution == "parallel" and spec.method != "flexdraft":
            raise ValueError(f"execution 'parallel' needs method 'flexdraft', not {spec.method!r}")
        self.options = ["plain", "decoupled"] + (["parallel"] if spec.method == "flexdraft" else [])

    # ---- decisions ------------------------------------------------------------------------------------------
    def decide(self, sched: SchedulerOutput) -> Decision:
        k = self.spec.num_speculative_tokens
        num_seqs = len(sched.scheduled)
        limit = self.spec.disable_by_batch_size
        if limit is not None and num_seqs > limit:
            return self._count(Decision("plain", 0))
        if self.spec.execution != "auto":
            return self._count(Decision(self.spec.execution, k))
        bucket = batch_bucket(num_seqs)
        count = self.decisions.get(bucket, 0)
        self.decisions[bucket] = count + 1
        for mode in self.options:  # warm-up: measure every option somewhere first
            if self.samples(mode) < WARMUP_SAMPLES:
                return self._decision(mode)
        spec_tokens = self._batch_tokens_per_step(sched)
        rates = {m: self.expected_rate(m, bucket, spec_tokens) for m in self.options}
        ranked = sorted(self.options, key=rates.__getitem__, reverse=True)
        best = rates[ranked[0]]
        for mode in ranked[1:]:  # plausible options never measured at this batch size
            if rates[mode] >= PLAUSIBLE * best and self._measured(mode, bucket) < WARMUP_SAMPLES:
                return self._decision(mode)
        if self.probe is not None and self.probe[1] > 0:
            mode, left = self.probe
            self.probe = (mode, left - 1)
            return self._decision(mode)
        if count % REEXPLORE_EVERY == REEXPLORE_EVERY - 1 and rates[ranked[1]] >= PROBE_WITHIN * best:
            self.probe = (ranked[1], PROBE_STEPS - 1)
            return self._decision(ranked[1])
        return self._decision(ranked[0])

    def _decision(self, mode: str) -> Decision:
        return self._count(Decision(mode, 0 if mode == "plain" else self.spec.num_speculative_tokens))

    def _count(self, d: Decision) -> Decision:
        self.mode_counts[d.mode] = self.mode_counts.get(d.mode, 0) + 1
        self.last_modes = [*self.last_modes[-1:], d.mode]
        return d

    def expected_tokens_per_step(self, mode: str) -> float:
        """E[emitted tokens per sequence per step] over all requests seen (the running per-position statistics)."""
        if mode == "plain":
            return 1.0
        return 1.0 + sum(self.acceptance[: self.spec.num_speculative_tokens])

    def _batch_tokens_per_step(self, sched: SchedulerOutput) -> float:
        """Mean over the batch of each request's running MAL (the global estimate for requests without one)."""
        fallback = self.expected_tokens_per_step("decoupled")
        per_seq = [getattr(getattr(s, "seq", None), "spec_tokens_per_step", None) for s in sched.scheduled]
        return sum(fallback if t is None else t for t in per_seq) / max(len(per_seq), 1)

    def samples(self, mode: str) -> int:
        return sum(st.n for (m, _), st in self.step_times.items() if m == mode)

    def _measured(self, mode: str, bucket: int) -> int:
        stat = self.step_times.get((mode, bucket))
        return stat.n if stat is not None else 0

    def _nearest(self, mode: str, bucket: int) -> int | None:
        """The measured bucket of ``mode`` closest to ``bucket`` (log scale; ties -> the larger)."""
        have = [b for (m, b), st in self.step_times.items() if m == mode and st.n > 0]
        if not have:
            return None
        return min(have, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), -b))

    def step_time(self, mode: str, bucket: int) -> float | None:
        """Estimated seconds per step of ``mode`` at ``bucket`` (see the module doc); None if never measured."""
        near = self._nearest(mode, bucket)
        if near is None:
            return None
        t = self.step_times[(mode, near)].seconds
        if (
            near != bucket
            and mode != "plain"
            and self._measured("plain", near)
            and self._measured("plain", bucket)
        ):
            t *= self.step_times[("plain", bucket)].seconds / self.step_times[("plain", near)].seconds
        return t

    def expected_rate(self, mode: str, bucket: int, spec_tokens: float | None = None) -> float:
        """Expected emitted tokens per second per sequence for ``mode`` at this batch-size bucket;
        ``spec_tokens`` = E[tokens per step] when speculating (default: the running statistics)."""
        t = self.step_time(mode, bucket)
        if t is None:
            return float("inf")
        tokens = 1.0 if mode == "plain" else spec_tokens or self.expected_tokens_per_step(mode)
        return tokens / max(t, 1e-9)

    # ---- feedback -------------------------------------------------------------------------------------------
    def observe(
        self, mode: str, num_seqs: int, seconds: float, per_position_acceptance: list[float] | None
    ) -> None:
        """Record one decode step's wall time (steps with prefill chunks are not representative: skip them).

        The time is recorded only when this step's decision equals the previous one (see the module doc);
        acceptance is recorded for every step that verified drafts."""
        previous = self.last_modes[0] if len(self.last_modes) == 2 else mode
        if previous == mode:
            self.step_times.setdefault((mode, batch_bucket(num_seqs)), _Stat()).add(seconds)
        if per_position_acceptance:
            n = max(len(self.acceptance), len(per_position_acceptance))
            step = per_position_acceptance + [0.0] * (n - len(per_position_acceptance))  # no draft there: 0
            if not self.acceptance:
                self.acceptance = list(step)
            else:
                self.acceptance += [0.0] * (n - len(self.acceptance))
                self.acceptance = [(1 - EMA) * a + EMA * b for a, b in zip(self.acceptance, step)]

    @staticmethod
    def observe_request(seq, num_draft_tokens: int, num_accepted: int) -> None:
        """Update one request's running MAL after a verification of ``num_draft_tokens`` drafts."""
        if num_draft_tokens == 0:
            return
        tokens = num_accepted + 1.0
        prev = seq.spec_tokens_per_step
        seq.spec_tokens_per_step = tokens if prev is None else (1 - EMA) * prev + EMA * tokens
