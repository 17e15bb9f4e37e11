"""Per-batch execution choice, made once by the engine and sent to every TP rank inside ModelInput.

Ranks that disagreed on whether or how to draft would deadlock in collectives (a known vLLM hang), so no
rank ever decides on its own. Each step the policy picks how to draft for the next step:

* ``plain``     — no drafts (plain decoding),
* ``decoupled`` — verify, then draft in a separate (small) forward,
* ``parallel``  — draft inside the verification forward (FlexDraft only: O(B^2) extra tokens per sequence).

and, for chains, how many drafts: ``decoupled/L`` is a chain cut to at most L drafts (``draft_lengths``; DFlash's
default k = 15 gives ``decoupled/3``, ``decoupled/7`` and ``decoupled``), each timed as its own option. A
shorter chain verifies fewer tokens per sequence, which is what a large batch pays for (session 36, H100, shipped
DFlash drafter, fixed chains of 3 / 7 / 15 drafts against plain decoding, paired medians of 2 rounds on GSM8K:
b=64 1.12 / 1.01 / 0.98x, b=16 1.32 / 1.54 / 1.53x, b=1 0.92 / 1.07 / 1.11x; MT-Bench, one round, b=16
1.10 / 0.96 / 0.83x; ``bench/results/h100-2026-12-06-s36/``).

With ``execution: auto`` it maximises expected emitted tokens per second = E[tokens per step] / step time,
where E[tokens per step] is the mean over the batch's requests of each request's estimated MAL, and step times
are measured online per (mode, batch-size bucket); each request's MAL estimate, and what a cut chain
emits, are :class:`flexspec.spec.mal_estimates.MALEstimates`' (its module doc says how and why).

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
* an option other than the best is re-measured (plain: ``PROBE_STEPS`` consecutive steps; a speculative mode: its
  draftless first step and ``PROBE_VERIFICATIONS`` verifying ones, which also refresh G) if its estimate is within
  ``PROBE_WITHIN`` of the best (of several, the one measured longest ago: ``_probe_target``; with two options the
  runner-up), after ``REEXPLORE_EVERY`` decisions of a bucket, then after twice as many each time, up to
  ``REEXPLORE_MAX``, so an estimate made under unlucky conditions (or a batch of requests whose estimates are
  low) does not lock a mode out, and a mode that keeps losing costs ever fewer probes (session 12, H200, batch
  1: probes every 64 steps were most of the 5% of speculative steps FlexDraft ``auto`` took on MT-Bench, and
  cost it ~3% of plain decoding's throughput); near a tie the interval does not grow: a probe of an option
  whose expected rate is at least ``PROBE_NEAR_TIE`` of the best's leaves it at ``REEXPLORE_EVERY`` (such a probe
  costs little, and a wrong choice there is what acceptance noise produces: ``bench.policy_replay`` over session
  33's traces, 8 seeds each, GSM8K b=1 with the break-even MAL near GSM8K's own had ``auto`` hold new requests on
  plain decoding between probes 1024 decisions apart, 0.864 of always-decoupled in one seed; worst point of 21
  0.864 -> 0.914 with session 37's H100 step times, 0.882 -> 0.915 with session 36's, means 0.9794 -> 0.9828 and
  0.9836 -> 0.9820); a probe that measures far from the estimate
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
* a step in which prompts join the batch is timed apart, as its mode's join step, and each option is ranked by its
  mean step time with joining prompts as frequent as they have lately been (``mean_step_time``);
* a decisive decision (best option ``HOLD_MARGIN`` ahead of the runner-up; plain decoding at any batch size, a
  speculative mode from ``HOLD_FROM`` sequences on) is held for up to ``HOLD_STEPS`` - 1 more decisions of the same
  batch (no prompt joining, no probe due) without ranking again: a ranking's host time (see policy_tuning);

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
from flexspec.spec.mal_estimates import MALEstimates
from flexspec.spec.probes import ProbeChoice
from flexspec.spec.step_times import StepTimeStat, batch_bucket, median
from flexspec.spec.switch_costs import entry_factor, round_trip_share

__all__ = ["Decision", "SpeculationPolicy", "entry_factor"]


@dataclass
class Decision:
    mode: str  # "plain" | "decoupled" | "parallel"
    num_speculative_tokens: int  # the drafts to propose this step (0: plain decoding)
    option: str = ""  # the policy's name for it ("decoupled/3": a chain of at most 3 drafts); default: mode
    # why: "best" (highest expected rate), "warmup" (an option not measured WARMUP_SAMPLES times yet), "measure"
    # (a plausible option not measured at this batch size), "probe" (a re-measurement), "join" (plain decoding
    # goes on in a step where prompts join: ENTER_AT_JOIN), "limit" (disable_by_batch_size), "forced" (warm-up
    # profile), "fixed" (execution is not auto)
    reason: str = "best"

    def __post_init__(self) -> None:
        self.option = self.option or self.mode


@dataclass
class SpeculationPolicy(MALEstimates, ProbeChoice):
    config: EngineConfig
    step_times: dict[tuple[str, int], StepTimeStat] = field(default_factory=dict)
    decisions: dict[int, int] = field(default_factory=dict)  # bucket -> count
    mode_counts: dict[str, int] = field(default_factory=dict)
    last_modes: list[str] = field(default_factory=list)  # the last two decisions (steady-state attribution)
    last_reason: str = ""  # the latest decision's ``Decision.reason`` (step logs)
    # the latest decision's expected tokens / s per option (margins and switch costs applied) and E[tokens per
    # speculative step] of its batch, where it ranked options (reason best / measure / probe), else None
    last_rates: dict[str, float] | None = None
    last_spec_tokens: float | None = None
    last_step_times: dict[tuple[str, int], float | None] | None = None  # step_time lookups behind last_rates
    probe: tuple[str, int] | None = None  # (mode, decisions left) of a running re-measurement
    # bucket -> (decision count of its next probe, the interval that set it)
    probe_due: dict[int, tuple[int, int]] = field(default_factory=dict)
    # (mode, bucket, estimated seconds) of the running probe, until its first timed step
    probe_estimate: tuple[str, int, float] | None = None
    # ("exit:MODE", bucket) and seconds of the latest step leaving speculation, recorded with the next step (below)
    exit_pending: tuple[tuple[str, int], float] | None = None
    after_exit: bool = False  # the latest observed step left speculation: the next one is no plain sample
    forced: str | None = None  # warm-up profile: every decision is this mode, step times are collected raw
    forced_full_drafts: bool = False  # warm-up profile: steps keep every draft allowed (verify_all_drafts)
    profile: dict[tuple[str, int], list[float]] = field(default_factory=dict)  # (mode, bucket) -> seconds
    num_decisions: int = 0  # auto decisions of every bucket: the clock of step-time staleness
    # of them, those that ranked the options (not held; bench.policy_replay prices them)
    num_rankings: int = 0
    # bucket -> moving share of its decisions in which prompts join the batch (see ``mean_step_time``)
    join_share: dict[int, float] = field(default_factory=dict)
    # decisions run before every step: what they look up is cached (host time of a host-bound b=64 step counts)
    _warmed: bool = False  # every option has WARMUP_SAMPLES step times
    _nearest_cache: dict[tuple[str, int], int | None] = field(default_factory=dict)
    _nearest_keys: int = -1  # len(step_times) when _nearest_cache was filled (keys are only ever added)
    _held: tuple[int, str, float, dict[str, float], float] | None = None  # (b, option, until, rates, tokens)
    _memo: dict[tuple[str, int], float | None] | None = None  # step_time's results while a decision ranks

    def __post_init__(self) -> None:
        spec = self.config.speculative_config
        assert spec is not None
        self.spec = spec
        if spec.execution == "parallel" and spec.method != "flexdraft":
            raise ValueError(f"execution 'parallel' needs method 'flexdraft', not {spec.method!r}")
        k = spec.num_speculative_tokens
        chains = spec.execution == "auto" and getattr(spec, "draft_tree_topk", 1) == 1
        shorter = spec.policy_draft_lengths()[:-1] if chains else []  # chain lengths the policy chooses among
        self.lengths = {"plain": 0, **{f"decoupled/{n}": n for n in shorter}, "decoupled": k, "parallel": k}
        self.options = ["plain", *(f"decoupled/{n}" for n in shorter), "decoupled"]
        self.options += ["parallel"] if spec.method == "flexdraft" else []
        self.max_chain_drafts = self.max_chain_drafts or k

    # ---- decisions ------------------------------------------------------------------------------------------
    def decide(self, sched: SchedulerOutput) -> Decision:
        k = self.spec.num_speculative_tokens
        self.last_rates = None
        num_seqs = len(sched.scheduled)
        limit = self.spec.disable_by_batch_size
        if limit is not None and num_seqs > limit:
            return self._count(Decision("plain", 0, reason="limit"))
        if self.forced is not None:
            return self._decision(self.forced, "forced")
        if self.spec.execution != "auto":
            return self._count(Decision(self.spec.execution, k, reason="fixed"))
        bucket = batch_bucket(num_seqs)
        count = self.decisions.get(bucket, 0)
        self.decisions[bucket] = count + 1
        self.num_decisions += 1
        share = self.join_share.get(bucket, 0.0)
        self.join_share[bucket] = share + tuning.JOIN_EMA * ((sched.num_prefills > 0) - share)
        after_plain = bool(self.last_modes) and self.last_modes[-1] == "plain"
        if not tuning.ENTER_AT_JOIN and after_plain and 0 < sched.num_prefills < num_seqs:
            return self._decision("plain", "join")  # prompts join a decoding batch: see ENTER_AT_JOIN
        if not self._warmed:  # warm-up: measure every option somewhere first
            for mode in self.options:
                if self.samples(mode) < tuning.WARMUP_SAMPLES:
                    return self._decision(mode, "warmup")
            self._warmed = True
        held, self._held = self._held, None
        across = held is not None and held[1] == "plain" and tuning.HOLD_PLAIN_ACROSS_JOINS
        if (
            held is not None
            and (held[0] == num_seqs or (across and batch_bucket(held[0]) == bucket))
            and (not sched.num_prefills or across)
            and count < held[2]
            and self.last_modes[-1:] == [held[1]]
        ):  # a decisive best option of a recent decision, same requests, no probe due: not ranked again
            self._held = held
            self.last_rates, self.last_spec_tokens = held[3], held[4]
            return self._decision(held[1])
        self._memo = {}  # step times looked up while ranking, until the decision returns (``_decision``)
        self.num_rankings += 1
        spec_tokens = self.batch_tokens_per_step(sched)
        tokens = {m: self.option_tokens(m, spec_tokens) for m in self.options}
        rates = {m: self.expected_rate(m, bucket, tokens[m]) for m in self.options}
        rates["plain"] *= tuning.SPEC_MARGIN  # near-ties go to plain decoding (see SPEC_MARGIN)
        if self.last_modes:  # a round trip plain -> speculation -> plain costs its switch steps
            last = self.last_modes[-1]
            if last == "plain":
                for m in self.options[1:]:
                    rates[m] *= self.round_trip_factor(m, bucket, tokens[m])
            else:  # leaving speculation commits to paying for the return
                rates["plain"] *= self.round_trip_factor(last, bucket, tokens[last])
        ranked = sorted(self.options, key=rates.__getitem__, reverse=True)
        self.last_rates, self.last_spec_tokens = rates, spec_tokens
        best = rates[ranked[0]]
        for mode in ranked[1:]:  # plausible options never measured at this batch size
            if (
                rates[mode] >= tuning.PLAUSIBLE * best
                and self._measured(mode, bucket) < tuning.WARMUP_SAMPLES
            ):
                return self._decision(mode, "measure")
        if self.probe is not None and self.probe[1] > 0:
            mode, left = self.probe
            self.probe = (mode, left - 1)
            return self._decision(mode, "probe")
        due, interval = self.probe_due.get(bucket, (tuning.REEXPLORE_EVERY - 1, tuning.REEXPLORE_EVERY))
        target = self._probe_target(ranked, rates, bucket) if count >= due else None
        gap = self._probe_gap(ranked[0], target, bucket, tokens) if target is not None else 0.0
        if target is not None and count >= due - interval + gap:
            near_tie = rates[target] >= tuning.PROBE_NEAR_TIE * rates[ranked[0]]
            interval = tuning.REEXPLORE_EVERY if near_tie else min(2 * interval, tuning.REEXPLORE_MAX)
            self.probe_due[bucket] = (count + interval, interval)
            steps = tuning.PROBE_STEPS if target == "plain" else 1 + tuning.PROBE_VERIFICATIONS
            self.probe = (target, steps - 1)
            self.probe_estimate = (target, bucket, self.step_time(target, bucket) or 0.0)
            return self._decision(target, "probe")
        hold_from = tuning.HOLD_PLAIN_FROM if ranked[0] == "plain" else tuning.HOLD_FROM  # see HOLD_STEPS
        if num_seqs >= hold_from and best >= tuning.HOLD_MARGIN * rates[ranked[1]]:
            later = due - interval + gap if target is not None else count + tuning.HOLD_STEPS
            until = min(count + tuning.HOLD_STEPS, due if count < due else later)
            self._held = (num_seqs, ranked[0], until, rates, spec_tokens)
        return self._decision(ranked[0])

    def _decision(self, option: str, reason: str = "best") -> Decision:
        if self._memo is not None:  # a ranking's lookups: kept for step logs (bench.engine_load)
            self.last_step_times, self._memo = self._memo, None
        return self._count(Decision(option.split("/")[0], self.lengths[option], option, reason))

    def _count(self, d: Decision) -> Decision:
        self.mode_counts[d.option] = self.mode_counts.get(d.option, 0) + 1
        self.last_modes = [*self.last_modes[-1:], d.option]
        self.last_reason = d.reason
        return d

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
        memo = self._memo
        if memo is not None:
            key = (mode, bucket)
            if key not in memo:
                memo[key] = self._step_time(mode, bucket)
            return memo[key]
        return self._step_time(mode, bucket)

    def _step_time(self, mode: str, bucket: int) -> float | None:
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

    def mean_step_time(self, mode: str, bucket: int) -> float | None:
        """Expected seconds per step of ``mode`` at ``bucket`` with prompts joining the batch as often as they
        have lately (``join_share``): (1 - p) t_decode + p t_join. ``t_join`` is the mode's measured step time
        with a joining prompt ("join:MODE", timed when the mode ran the step before too; a long-run median
        like a switch step's); a mode whose join steps were not timed yet is assumed to pay what plain decoding
        pays for a prompt on top of its decode step (or nothing, before plain's were timed). Speculative join
        steps cost far more than plain ones (H100, session 42: 3.3-3.9 ms at b=64 against 1.3 ms, decode steps
        2.0-2.7 against 1.1), and at large batches a prompt joins in most steps, so decode steps alone made
        speculation look cheaper than it was (``bench.policy_replay``, MT-Bench b=64: ``auto`` 0.80x plain)."""
        t = self.step_time(mode, bucket)
        p = self.join_share.get(bucket, 0.0)
        if t is None or p <= 0.0:
            return t
        t_join = self.step_time(f"join:{mode}", bucket)
        if t_join is None:
            t_plain, t_plain_join = self.step_time("plain", bucket), self.step_time("join:plain", bucket)
            t_join = t + (t_plain_join - t_plain) if t_plain and t_plain_join else t
        return (1.0 - p) * t + p * t_join

    def expected_rate(self, mode: str, bucket: int, spec_tokens: float | None = None) -> float:
        """Expected emitted tokens per second per sequence for ``mode`` at this batch-size bucket
        (``mean_step_time``: prompts joining included); ``spec_tokens`` = E[tokens per step] when speculating
        (default: the running statistics)."""
        t = self.mean_step_time(mode, bucket)
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
        verified_length: int | None = None,
        prefill: bool = False,
    ) -> None:
        """Record one step's wall time and acceptance. ``seconds`` is None for a step not to be timed;
        ``prefill``: prompts joined in this step, whose time is then the mode's join-step time ("join:MODE",
        see ``mean_step_time``) if the mode also ran the step before (not during the warm-up profile).

        The time is recorded as the mode's when this step's decision equals the previous one (``previous``:
        the decision made before this step's; default: the one before the latest decision, which is this step's
        unless the next step was decided already, as with async scheduling; see the module doc), as a switch
        step's (``switch_time``) when one of the two is plain decoding and the other is not; acceptance
        is recorded for every step that verified drafts; a plain step that verified none ages G's evidence
        (``PRIOR_HALF_LIFE``; a step entering speculation, drafting without verifying, does not). Between two
        chain lengths ("decoupled/L" options) the step is the previous option's (it verifies that option's
        drafts; drafting costs the same). ``verified_length``: the most drafts the verified sequences were
        allowed (the option that drafted them); positions past it keep their acceptance statistics.

        Leaving speculation costs two steps, not one: the plain step after the exit step is not launched ahead
        of its predecessor's result (H100, session 43, HumanEval / MT-Bench b = 16-64: exit steps ~1.9-2.9 ms,
        the plain step after them 1.3-2.1 ms, steady plain steps 0.9-1.2 ms). With
        ``PRICE_EXIT_FOLLOWER`` (off by default: see policy_tuning) an exit step's time is recorded with the next
        step: plus what that step took over plain decoding's estimate if it is a pure plain decode step at the
        same bucket; either way the plain step after an exit is none of plain decoding's samples (nor a plain join
        step's): plain's estimate is of steady, launched-ahead steps (``PROBE_STEPS``)."""
        key = None
        after_exit, self.after_exit = self.after_exit, False
        pending, self.exit_pending = self.exit_pending, None
        if pending is not None:
            (exit_key, t_exit), bucket = pending, batch_bucket(num_seqs)
            follows = seconds is not None and not prefill and mode == "plain" and exit_key[1] == bucket
            follows = follows and self.previous_mode(mode, previous) == "plain"
            t_plain = self.step_time("plain", bucket) if follows else None
            extra = max(0.0, seconds - t_plain) if t_plain else 0.0  # t_plain: only with a timed step
            self.step_times.setdefault(exit_key, StepTimeStat()).add(t_exit + extra, self.num_decisions)
            if t_plain:
                self.observe_acceptance(mode, per_position_acceptance, verified_length)
                return
        if after_exit and mode == "plain" and self.forced is None:
            pass  # the plain step after an exit (not launched ahead): no steady plain sample, nor a join step's
        elif seconds is not None and prefill:
            if self.previous_mode(mode, previous) == mode and self.forced is None:
                self.step_times.setdefault((f"join:{mode}", batch_bucket(num_seqs)), StepTimeStat()).add(
                    seconds, self.num_decisions
                )
        elif seconds is not None:
            prev = self.previous_mode(mode, previous)
            if prev == mode:
                key = (mode, batch_bucket(num_seqs))
            elif prev == "plain":  # the step entering speculation (switch_time)
                key = (f"enter:{mode}", batch_bucket(num_seqs))
            elif mode == "plain":  # the step leaving it
                key = (f"exit:{prev}", batch_bucket(num_seqs))
            elif prev.startswith("decoupled") and mode.startswith("decoupled"):
                key = (prev, batch_bucket(num_seqs))  # another chain length: the step verifies prev's drafts
        if key is not None:
            if self.forced is not None:
                self.profile.setdefault(key, []).append(seconds)
            elif key[0].startswith("exit:") and tuning.PRICE_EXIT_FOLLOWER:
                self.exit_pending = (key, seconds)
            else:
                self.step_times.setdefault(key, StepTimeStat()).add(seconds, self.num_decisions)
                if key[0] == mode:
                    self._check_probe(key, seconds)
        # this step left speculation (timed or not): the next one is not launched ahead of it
        self.after_exit = (
            self.forced is None and mode == "plain" and self.previous_mode(mode, previous) != "plain"
        )
        self.observe_acceptance(mode, per_position_acceptance, verified_length)

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
        self.forced, self.forced_full_drafts = None, False
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
        self.probe_estimate = self.exit_pending = self._held = None
        self.after_exit = False
        self.last_modes = []
        return out
