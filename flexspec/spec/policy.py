"""Per-batch execution choice, made once by the engine and sent to every TP rank inside ModelInput.

Ranks that disagreed on whether or how to draft would deadlock in collectives (a known vLLM hang), so no
rank ever decides on its own. Each step the policy picks how to draft for the next step:

* ``plain``     — no drafts (plain decoding),
* ``decoupled`` — verify, then draft in a separate (small) forward,
* ``parallel``  — draft inside the verification forward (FlexDraft only: O(B^2) extra tokens per sequence).

With ``execution: auto`` it maximises expected emitted tokens per second = E[tokens per step] / step time,
where E[tokens per step] is the mean over the batch's requests of each request's estimated MAL, and step times
are measured online per (mode, batch-size bucket). A request's MAL estimate:

* the prior G is the population's: the mean of accepted + 1 over the last ~``PRIOR_WINDOW`` verifications of
  all requests; a request not verified yet uses G. Until ``MIN_PRIOR_VERIFICATIONS`` verifications G is
  optimistic (1 + k: every draft accepted), so a fresh engine speculates until it knows what drafts are worth
  here (the warm-up profile's dummy prompt does not set G, see ``finish_profile``): G is learnt only from
  verifications, and an engine that starts on plain decoding learns it only from probes. G's evidence ages:
  each plain step that verifies nothing (and that the engine reports: ``observe`` is not called for steps with a
  prompt chunk that does not end its prompt) multiplies the number of verifications G stands for (at most
  ``PRIOR_WINDOW``) by ``PRIOR_KEEP`` (half-life ``PRIOR_HALF_LIFE`` steps, floor ``PRIOR_MIN_WEIGHT``), so after
  a plain stretch a probe's fresh verifications weigh against a few old ones, not ``PRIOR_WINDOW`` of them. A
  workload shift is thus learnt from a few probes (session 30, H100: after MT-Bench, MAL 1.95, ``auto`` ran
  GSM8K, MAL 3.2, at batch 4 on plain decoding for 1024 of its 1027 steps, 0.71x of always-decoupled, each
  probe moving G by ~0.08; ``bench.policy_replay`` with MT-Bench first, b = 1-64, 4 seeds: GSM8K b=4 ``auto`` /
  best 0.878 (worst 0.752) -> 1.001 (worst 1.000), other points unchanged within 0.5%). The floor keeps a probe's
  few verifications from swinging G: GSM8K's accepted lengths vary widely, and with a floor of 16 a replay of
  b=4 alone (8 seeds) lost 2.5% on average to probes that happened to draw low (mean 0.904 vs 0.928 without
  aging; floor 32: 0.929; ``bench/results/cpu-2026-12-05-s30/``);
* its own running MAL r is an EMA (``EMA``) of accepted + 1 per verification that starts from G, so after n
  verifications the prior still weighs (1 - EMA)^n (shrinkage: one unlucky first step does not send a request
  to plain decoding);
* the policy uses G + c w (r - G), where w, the weight of the request's own evidence, is 1 after a verification
  and shrinks by ``STALE_KEEP`` (half-life ``STALE_HALF_LIFE``) for every step the request emits without
  verifying drafts in a plain step (no drafts asked for anyone), since a request that is not drafted for gets no
  new evidence (a speculative step in which the request verifies nothing - the step entering speculation, or an
  n-gram request with no match in the previous step - does not age it since session 30); and
  c = n / (n + ``REQUEST_PRIOR_WEIGHT``) grows with the request's number of verifications n, so a few unlucky
  verifications early on move the estimate little and a long run of failures moves it almost all the way. A
  request put on plain for a low r is so speculated on again after a few plain steps (r = 1, G = 2.7 after 60
  failed verifications, break-even MAL 1.8: after 3), and one whose drafts still fail returns to plain after
  that verification (r itself is kept).

Why: a wrong ``plain`` costs MAL - 1 tokens per step (~1.8 on GSM8K), a wrong speculative step only its extra
time (~0.2-0.5 of a plain step), and a request's acceptance has little memory: with the shipped DFlash drafter
on GSM8K (8 requests, 571 verifications) accepted lengths 4-16 tokens apart correlate ~0.1, from 32 on ~0.
Without the decay a request stuck on plain was re-tested only by the runner-up probe (below), and at batch 1
``auto`` trailed always-``decoupled`` (issue 6). Without c (c = 1), once plain steps got cheaper (async
scheduling, session 12: plain 0.77 ms, decoupled 1.73 ms per step at batch 1, break-even MAL 2.25 x
``SPEC_MARGIN``), three rejected verifications in a row (EMA 0.2: r 3 -> 2.28) sent a GSM8K request (G ~3) to
plain: 51% of the batch-1 steps were plain and ``auto`` reached 0.84 of always-``decoupled``. With c weighing
half at 8 verifications (session 13) GSM8K requests still left speculation on noise (H200, batch 1: 54% of the
steps plain, ``auto`` 0.85 of always-``decoupled``); ``bench.policy_replay`` over the shipped DFlash drafter's
acceptance traces (GSM8K, MT-Bench, HumanEval, b = 1-64, H200 step times) put the worst point of ``auto``
against the best fixed mode at 0.955 with (8, ``PRIOR_WINDOW`` 256), 0.966 with (32, 256) and 0.976 with
(32, 128): a shorter prior window also lets G follow a change of workload (GSM8K -> MT-Bench) sooner.

Step times:

* warm-up profile at engine start (``EngineConfig.speculation_profile_steps``, on by default on GPU): every
  option is timed for a few steps at every batch-size bucket on dummy requests (``LLMEngine.profile_speculation``);
  each (mode, bucket) starts from the median;
* without it (or for what it skipped), each option is measured ``WARMUP_SAMPLES`` times, at whatever batch
  size comes first;
* a bucket not measured yet for a mode borrows the nearest measured bucket's time, scaled by how plain
  decoding's time changes between the two buckets; so a new batch size does not re-measure every option:
  only options whose estimate is within ``PLAUSIBLE`` of the best are measured there (the best one is
  simply used, which measures it);
* the runner-up is re-measured (plain: ``PROBE_STEPS`` consecutive steps; a speculative mode: its draftless
  first step and ``PROBE_VERIFICATIONS`` verifying ones, which also refresh G) if its estimate is within ``PROBE_WITHIN``
  of the best, after ``REEXPLORE_EVERY`` decisions of a bucket, then after twice as many each time, up to
  ``REEXPLORE_MAX``, so an estimate made under unlucky conditions (or a batch of requests whose estimates are
  low) does not lock a mode out, and a mode that keeps losing costs ever fewer probes (session 12, H200, batch
  1: probes every 64 steps were most of the 5% of speculative steps FlexDraft ``auto`` took on MT-Bench, and
  cost it ~3% of plain decoding's throughput); a probe that measures far from the estimate
  (``PROBE_SURPRISE``) restarts the back-off; and probes are spaced so that their expected cost stays within
  ``PROBE_BUDGET`` of the bucket's throughput (``_probe_gap``; H100, b=64, plain 1.13 ms and decoupled DFlash
  3.25 ms per step: at MT-Bench's MAL 1.95 a probe loses 4.2 ms, so probes come >= 373 decisions apart instead of
  64; at GSM8K's 3.24, a near-tie, 1.3 ms and >= 115 apart;
  ``bench.policy_replay`` on H100 step times, 4 seeds: mean ``auto`` / best at b=64 0.949 -> 0.955 on GSM8K,
  0.974 -> 0.980 on MT-Bench, 0.984 -> 0.995 on HumanEval);
* an estimate is stale once its mode went ``STALE_AFTER`` decisions without a new step time; a stale estimate
  is the lower of its window's median and the median of the last ``LONG_WINDOW`` samples, because speculative
  step times wander in spells (H200, batch 1, session 16: the decoupled median of the last 15 steps moved
  between 1.64 and 2.16 ms within a few hundred steps while plain stayed at 0.74-0.83 ms). Leaving speculation
  in a slow spell froze the slow median: a whole GSM8K request (120 steps) then ran on plain at an estimated
  MAL of 2.54 against a break-even of 2.67, where the long-run median (~1.72 ms) puts it at 2.33. A mode is tried
  again after ``STALE_AFTER`` decisions, and the first step time of a stale mode starts a new window, so a
  return (or a probe) is judged by what it measures now, not outvoted by the old window's 15 slow steps; a
  mode that still measures slow is left again;

A step's wall time covers verifying the drafts decided one step earlier plus drafting for the decision made now, so
only steps whose decision equals the previous one are recorded as the mode's (steady state of one mode); the steps
switching between plain decoding and a speculative mode are timed apart, per mode and bucket (``switch_time``:
"enter" drafts without verifying, "exit" verifies the last drafts without drafting; the warm-up profile times
both). Switching from plain decoding to speculation costs a step: the first speculative step has no drafts to
verify yet, so it pays for one token. Speculation is entered only if it pays with the switch counted: over
``SWITCH_HORIZON`` speculative steps, one of which emits 1 token instead of m, the entering step priced as a steady
one (``entry_factor``) until both switch steps were timed, then at their measured times (``round_trip_factor``,
bounded as ``flexspec.spec.switch_costs`` says; session 30's H100 logs: 0.9-1.3 steady speculative steps at b=16-64
with that session's final code, entering up to 4.5 before its cheaper entry, at b=1-4 entering ~0.5-1.3 and leaving
~1.8-2.6). ``bench.policy_replay`` over session 26's H200 times, 21 points x 4 seeds,
``bench/results/cpu-2026-12-06-s32/replay/``, mean ``auto`` / best before -> after with switch steps at 1 / 1.2 /
1.6-1.3 steady steps (``--switch-costs``): 0.9758 -> 0.9769, 0.9743 -> 0.9749, 0.9725 -> 0.9752; the worst point,
GSM8K b=64 (the replay's traces make always-decoupled 1.2x plain there; the priced way back keeps ``auto``
speculating longer once in), ``auto`` / plain 0.892 -> 0.905, 0.890 -> 0.914, 0.888 -> 0.931. Leaving speculation
likewise needs plain decoding to win by that margin (leaving now commits to paying for the way back). The horizon
is fixed: a running mean of the stretches the policy chose (tried in session 13) fed back on itself, as requests'
short-memory estimates crossing the band made stretches short, short stretches widened the band and GSM8K requests
at batch 1 (MAL 3.1) spent 80% of their steps on plain decoding. Without the entry cost, requests whose estimates
hovered around the break-even MAL flipped between the modes, each return costing a draftless step (session 12,
H200, batch 1, DFlash on MT-Bench: 17% of steps speculative at MAL 2.09 against a break-even of 2.1; ``auto`` 0.92x
of plain).

The first samples of a (mode, bucket) keep their minimum (one-off costs such as a kernel's first compile
must not set the estimate), later ones the median of a window (``StepTimeStat``). Near-ties go to plain decoding
(``SPEC_MARGIN``): a speculative step also pays what the step-time table does not see (a drafter's work on
prefill chunks, more variance), so speculation must promise a clear gain. ``disable_by_batch_size`` (vLLM)
forces plain decoding above a batch size.

The constants named here live in :mod:`flexspec.spec.policy_tuning` (read at call time, so replays and tests can
change them); the step-time statistic and the batch-size buckets in :mod:`flexspec.spec.step_times`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from configs.engine import EngineConfig
from flexspec.engine.scheduler import SchedulerOutput
from flexspec.spec import policy_tuning as tuning
from flexspec.spec.step_times import StepTimeStat, batch_bucket, median
from flexspec.spec.switch_costs import entry_factor, probe_time_lost, round_trip_share

__all__ = ["Decision", "SpeculationPolicy", "entry_factor"]


@dataclass
class Decision:
    mode: str  # "plain" | "decoupled" | "parallel"
    num_speculative_tokens: int


@dataclass
class SpeculationPolicy:
    config: EngineConfig
    step_times: dict[tuple[str, int], StepTimeStat] = field(default_factory=dict)
    decisions: dict[int, int] = field(default_factory=dict)  # bucket -> count
    mode_counts: dict[str, int] = field(default_factory=dict)
    acceptance: list[float] = field(default_factory=list)  # per-position acceptance (EMA over steps)
    last_modes: list[str] = field(default_factory=list)  # the last two decisions (steady-state attribution)
    probe: tuple[str, int] | None = None  # (mode, decisions left) of a running re-measurement
    # bucket -> (decision count of its next probe, the interval that set it)
    probe_due: dict[int, tuple[int, int]] = field(default_factory=dict)
    # (mode, bucket, estimated seconds) of the running probe, until its first timed step
    probe_estimate: tuple[str, int, float] | None = None
    forced: str | None = None  # warm-up profile: every decision is this mode, step times are collected raw
    profile: dict[tuple[str, int], list[float]] = field(default_factory=dict)  # (mode, bucket) -> seconds
    prior_tokens_per_step: float | None = None  # G: mean accepted + 1 over ~PRIOR_WINDOW verifications
    num_verifications: int = 0  # of all requests (MIN_PRIOR_VERIFICATIONS)
    prior_weight: float = 0.0  # verifications G stands for: + 1 per verification up to PRIOR_WINDOW, aged
    num_decisions: int = 0  # auto decisions of every bucket: the clock of step-time staleness
    # the most drafts one step can accept: num_speculative_tokens for chains, a draft tree's depth limit when the
    # engine knows its drafter's (in-process: ``Drafter.max_chain_drafts``); bounds the prior and the warm-up
    max_chain_drafts: int = 0
    # decisions run before every step: what they look up is cached (host time of a host-bound b=64 step counts)
    _warmed: bool = False  # every option has WARMUP_SAMPLES step times
    _nearest_cache: dict[tuple[str, int], int | None] = field(default_factory=dict)
    _nearest_keys: int = -1  # len(step_times) when _nearest_cache was filled (keys are only ever added)

    def __post_init__(self) -> None:
        spec = self.config.speculative_config
        assert spec is not None
        self.spec = spec
        if spec.execution == "parallel" and spec.method != "flexdraft":
            raise ValueError(f"execution 'parallel' needs method 'flexdraft', not {spec.method!r}")
        self.options = ["plain", "decoupled"] + (["parallel"] if spec.method == "flexdraft" else [])
        self.max_chain_drafts = self.max_chain_drafts or spec.num_speculative_tokens

    # ---- decisions ------------------------------------------------------------------------------------------
    def decide(self, sched: SchedulerOutput) -> Decision:
        k = self.spec.num_speculative_tokens
        num_seqs = len(sched.scheduled)
        limit = self.spec.disable_by_batch_size
        if limit is not None and num_seqs > limit:
            return self._count(Decision("plain", 0))
        if self.forced is not None:
            return self._decision(self.forced)
        if self.spec.execution != "auto":
            return self._count(Decision(self.spec.execution, k))
        bucket = batch_bucket(num_seqs)
        count = self.decisions.get(bucket, 0)
        self.decisions[bucket] = count + 1
        self.num_decisions += 1
        if not self._warmed:  # warm-up: measure every option somewhere first
            for mode in self.options:
                if self.samples(mode) < tuning.WARMUP_SAMPLES:
                    return self._decision(mode)
            self._warmed = True
        spec_tokens = self.batch_tokens_per_step(sched)
        rates = {m: self.expected_rate(m, bucket, spec_tokens) for m in self.options}
        rates["plain"] *= tuning.SPEC_MARGIN  # near-ties go to plain decoding (see SPEC_MARGIN)
        if self.last_modes:  # a round trip plain -> speculation -> plain costs its switch steps
            if self.last_modes[-1] == "plain":
                for m in self.options[1:]:
                    rates[m] *= self.round_trip_factor(m, bucket, spec_tokens)
            else:  # leaving speculation commits to paying for the return
                rates["plain"] *= self.round_trip_factor(self.last_modes[-1], bucket, spec_tokens)
        ranked = sorted(self.options, key=rates.__getitem__, reverse=True)
        best = rates[ranked[0]]
        for mode in ranked[1:]:  # plausible options never measured at this batch size
            if (
                rates[mode] >= tuning.PLAUSIBLE * best
                and self._measured(mode, bucket) < tuning.WARMUP_SAMPLES
            ):
                return self._decision(mode)
        if self.probe is not None and self.probe[1] > 0:
            mode, left = self.probe
            self.probe = (mode, left - 1)
            return self._decision(mode)
        due, interval = self.probe_due.get(bucket, (tuning.REEXPLORE_EVERY - 1, tuning.REEXPLORE_EVERY))
        if (
            count >= due
            and rates[ranked[1]] >= tuning.PROBE_WITHIN * best
            and count >= due - interval + self._probe_gap(ranked[0], ranked[1], bucket, spec_tokens)
        ):
            interval = min(2 * interval, tuning.REEXPLORE_MAX)
            self.probe_due[bucket] = (count + interval, interval)
            steps = tuning.PROBE_STEPS if ranked[1] == "plain" else 1 + tuning.PROBE_VERIFICATIONS
            self.probe = (ranked[1], steps - 1)
            self.probe_estimate = (ranked[1], bucket, self.step_time(ranked[1], bucket) or 0.0)
            return self._decision(ranked[1])
        return self._decision(ranked[0])

    def _probe_gap(self, best: str, runner_up: str, bucket: int, spec_tokens: float) -> float:
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
        lost = probe_time_lost(best, runner_up, t_b, t_r, spec_tokens, t_e, t_x)
        return lost / (tuning.PROBE_BUDGET * t_b)

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

    def prior(self) -> float:
        """G: the population's MAL, for requests with no (or stale) evidence of their own (see the module doc):
        the running mean of the requests' verifications once ``MIN_PRIOR_VERIFICATIONS`` were reported, 1 + k
        (every draft of the longest path accepted: ``max_chain_drafts``) before; 1 + the per-position
        acceptance for callers that report steps (``observe``) but no requests (``observe_request``)."""
        g = self.prior_tokens_per_step
        if g is None and self.acceptance:
            return self.expected_tokens_per_step("decoupled")
        if g is None or self.num_verifications < tuning.MIN_PRIOR_VERIFICATIONS:
            return 1.0 + self.max_chain_drafts
        return g

    def request_tokens_per_step(self, seq, prior: float | None = None) -> float:
        """A request's estimated MAL: G + c w (r - G) (see the module doc); ``prior`` = G when already known."""
        g = self.prior() if prior is None else prior
        r = getattr(seq, "spec_tokens_per_step", None)
        if r is None:
            return g
        n = getattr(seq, "spec_num_verifications", 1)
        return g + n / (n + tuning.REQUEST_PRIOR_WEIGHT) * seq.spec_estimate_weight * (r - g)

    def batch_tokens_per_step(self, sched: SchedulerOutput) -> float:
        """Mean over the batch of each request's estimated MAL (``request_tokens_per_step``, inlined on the
        engine's sequences: this runs before every step, for every request of the batch)."""
        g = self.prior()
        scheduled = sched.scheduled
        half = tuning.REQUEST_PRIOR_WEIGHT  # a local: ~3 us per b=64 decision
        try:
            own = 0.0
            for s in scheduled:
                seq = s.seq
                r = seq.spec_tokens_per_step
                if r is not None:
                    n = seq.spec_num_verifications
                    own += n / (n + half) * seq.spec_estimate_weight * (r - g)
            return g + own / max(len(scheduled), 1)
        except AttributeError:  # entries without the engine's per-request fields
            total = sum(self.request_tokens_per_step(getattr(s, "seq", None), g) for s in scheduled)
            return total / max(len(scheduled), 1)

    def samples(self, mode: str) -> int:
        return sum(st.n for (m, _), st in self.step_times.items() if m == mode)

    def _measured(self, mode: str, bucket: int) -> int:
        stat = self.step_times.get((mode, bucket))
        return stat.n if stat is not None else 0

    def _nearest(self, mode: str, bucket: int) -> int | None:
        """The measured bucket of ``mode`` closest to ``bucket`` (log scale; ties -> the larger)."""
        if self._nearest_keys != len(self.step_times):
            self._nearest_cache.clear()
            self._nearest_keys = len(self.step_times)
        key = (mode, bucket)
        if key not in self._nearest_cache:
            have = [b for (m, b), st in self.step_times.items() if m == mode and st.n > 0]
            self._nearest_cache[key] = (
                min(have, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), -b)) if have else None
            )
        return self._nearest_cache[key]

    def step_time(self, mode: str, bucket: int) -> float | None:
        """Estimated seconds per step of ``mode`` at ``bucket`` (see the module doc), or of a switch step
        (``mode`` "enter:MODE" / "exit:MODE", see ``switch_time``); None if never measured."""
        near = self._nearest(mode, bucket)
        if near is None:
            return None
        stat = self.step_times[(mode, near)]
        if ":" in mode:  # switch steps come a few per hundred steps: no short window
            t = min(stat.history) if stat.n < tuning.WARMUP_SAMPLES else stat.long_run()
        else:
            t = stat.seconds
            if self.num_decisions - stat.recorded_at > tuning.STALE_AFTER and stat.n >= tuning.WARMUP_SAMPLES:
                t = min(t, stat.long_run())  # a window measured in a slow spell must not lock the mode out
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

    def switch_time(self, kind: str, mode: str, bucket: int) -> float | None:
        """Measured seconds of the step switching between plain decoding and speculative ``mode`` at
        ``bucket`` (``kind`` "enter": plain -> ``mode``, drafts without verifying; "exit": ``mode`` -> plain,
        verifies the last drafts without drafting): the minimum of its first ``WARMUP_SAMPLES`` samples, then
        the median of its last ``LONG_WINDOW`` (switches come a few per hundred steps, so no short window);
        scaled from the nearest measured bucket like a mode's (``step_time``). None if never measured."""
        return self.step_time(f"{kind}:{mode}", bucket)

    def round_trip_factor(self, mode: str, bucket: int, tokens_per_step: float) -> float:
        """Share of ``mode``'s steady-state rate left over a stretch entered from plain decoding and left again
        (``switch_costs.round_trip_share``, with the switch steps at ``bucket`` once measured)."""
        t_s = self.step_time(mode, bucket)
        t_e, t_x = self.switch_time("enter", mode, bucket), self.switch_time("exit", mode, bucket)
        return round_trip_share(tokens_per_step, t_s, t_e, t_x)

    def estimates_ms(self) -> dict[str, float]:
        """{"mode@bucket": ms}: every measured (mode, bucket)'s estimate as the policy uses it (``step_time``;
        switch steps as "enter:mode" / "exit:mode")."""
        return {f"{m}@{b}": round((self.step_time(m, b) or 0.0) * 1e3, 4) for m, b in sorted(self.step_times)}

    # ---- feedback -------------------------------------------------------------------------------------------
    def previous_mode(self, mode: str, previous: str | None = None) -> str:
        """The decision before the step being observed (``observe``'s ``previous``): as given, else the one
        before the latest decision (or ``mode`` before two decisions were made)."""
        if previous is not None:
            return previous
        return self.last_modes[0] if len(self.last_modes) == 2 else mode

    def observe(
        self,
        mode: str,
        num_seqs: int,
        seconds: float | None,
        per_position_acceptance: list[float] | None,
        previous: str | None = None,
    ) -> None:
        """Record one step's wall time and acceptance. ``seconds`` is None for steps that are not pure decode
        steps (a prompt prefilled in the same step makes it unrepresentative; the engine leaves those out).

        The time is recorded as the mode's when this step's decision equals the previous one (``previous``:
        the decision made before this step's; default: the one before the latest decision, which is this step's
        unless the next step was decided already, as with async scheduling; see the module doc), as a switch
        step's (``switch_time``) when one of the two is plain decoding and the other is not; acceptance
        is recorded for every step that verified drafts; a plain step that verified none ages G's evidence
        (``PRIOR_HALF_LIFE``; a step entering speculation, drafting without verifying, does not)."""
        key = None
        if seconds is not None:
            prev = self.previous_mode(mode, previous)
            if prev == mode:
                key = (mode, batch_bucket(num_seqs))
            elif prev == "plain":  # the step entering speculation (switch_time)
                key = (f"enter:{mode}", batch_bucket(num_seqs))
            elif mode == "plain":  # the step leaving it
                key = (f"exit:{prev}", batch_bucket(num_seqs))
        if key is not None:
            if self.forced is not None:
                self.profile.setdefault(key, []).append(seconds)
            else:
                self.step_times.setdefault(key, StepTimeStat()).add(seconds, self.num_decisions)
                if key[0] == mode:
                    self._check_probe(key, seconds)
        if not per_position_acceptance:
            if mode == "plain" and self.prior_weight > tuning.PRIOR_MIN_WEIGHT:
                self.prior_weight = max(self.prior_weight * tuning.PRIOR_KEEP, tuning.PRIOR_MIN_WEIGHT)
            return
        n = max(len(self.acceptance), len(per_position_acceptance))
        step = per_position_acceptance + [0.0] * (n - len(per_position_acceptance))  # no draft there: 0
        if not self.acceptance:
            self.acceptance = list(step)
        else:
            self.acceptance += [0.0] * (n - len(self.acceptance))
            self.acceptance = [(1 - tuning.EMA) * a + tuning.EMA * b for a, b in zip(self.acceptance, step)]

    def _check_probe(self, key: tuple[str, int], seconds: float) -> None:
        """A probe's step far from the estimate it re-measured (``PROBE_SURPRISE``) makes the estimate stale:
        that bucket's probes start over at ``REEXPLORE_EVERY`` (the median needs a few samples to move)."""
        ref = self.probe_estimate
        if ref is None or ref[:2] != key:
            return
        self.probe_estimate = None
        if abs(seconds - ref[2]) > tuning.PROBE_SURPRISE * ref[2]:
            bucket = key[1]
            self.probe_due[bucket] = (
                self.decisions.get(bucket, 0) + tuning.REEXPLORE_EVERY,
                tuning.REEXPLORE_EVERY // 2,
            )

    def finish_profile(self) -> dict[str, float]:
        """End the warm-up profile: each (mode, bucket) measured there starts from the median of its step
        times (later steps update it as usual; entries with fewer than ``WARMUP_SAMPLES`` samples stay open to
        the warm-up rule). The dummy requests' acceptance is dropped: one fixed prompt says little about the
        workload (session 14, H200: its MAL 1.44 against GSM8K's 3.0 kept ``auto`` on plain decoding for half
        of GSM8K's batch-1 steps, G learning one verification per probe), so serving starts from the optimistic
        prior (``prior``). Returns {"mode@bucket": median ms}."""
        self.forced = None
        self._warmed = False
        out = {}
        for (mode, bucket), times in sorted(self.profile.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            stat = StepTimeStat()
            for t in times[-tuning.STAT_WINDOW :]:
                stat.add(t)
            med = stat.seconds = median(stat.window)
            self.step_times[(mode, bucket)] = stat
            out[f"{mode}@{bucket}"] = round(med * 1e3, 4)
        self.profile.clear()
        self.num_verifications, self.prior_tokens_per_step, self.acceptance = 0, None, []
        self.prior_weight = 0.0
        self.num_decisions = 0
        self.mode_counts.clear()
        self.decisions.clear()
        self.probe_due.clear()
        self.probe_estimate = None
        self.last_modes = []
        return out

    def age_requests(self, seqs) -> None:
        """Requests that emitted a token without verifying drafts (a plain step): their own MAL evidence weighs
        ``STALE_KEEP`` times less against the prior (see the module doc). One call per step for all of them
        (at batch 64 a call per request was ~0.3 us each of the step's host time)."""
        keep = tuning.STALE_KEEP
        for seq in seqs:
            seq.spec_estimate_weight *= keep

    def observe_request(self, seq, num_draft_tokens: int, num_accepted: int) -> None:
        """Update one request's MAL estimate after a step that emitted tokens for it, having verified
        ``num_draft_tokens`` drafts (0: a plain step, whose only effect is to age the request's own evidence),
        and the prior G after a verification. Called once per emitting step and request, by the engine only
        (the decision is made there and broadcast to every rank)."""
        if num_draft_tokens == 0:
            self.age_requests((seq,))
            return
        tokens = num_accepted + 1.0
        self.num_verifications += 1
        self.prior_weight = min(self.prior_weight + 1.0, tuning.PRIOR_WINDOW)
        g = self.prior_tokens_per_step
        g = tokens if g is None else g + (tokens - g) / self.prior_weight
        self.prior_tokens_per_step = g
        prev = seq.spec_tokens_per_step
        seq.spec_tokens_per_step = (1 - tuning.EMA) * (g if prev is None else prev) + tuning.EMA * tokens
        seq.spec_estimate_weight = 1.0
        seq.spec_num_verifications = getattr(seq, "spec_num_verifications", 0) + 1
