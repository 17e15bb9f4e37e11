"""The speculation policy's tunable constants (:mod:`flexspec.spec.policy`, whose module doc says what each one
does and why it has its value). Every part of the policy reads them from this module at call time, so
``bench.policy_replay --set NAME=VALUE`` and tests can change them (``monkeypatch.setattr(policy_tuning, ...)``);
the ``*_KEEP`` values follow their ``*_HALF_LIFE`` and are recomputed by whoever changes one."""

WARMUP_SAMPLES = 3  # measurements per (mode, bucket) before the policy trusts it
REEXPLORE_EVERY = 64  # decisions per bucket before the first re-measurement of the runner-up
REEXPLORE_MAX = 1024  # the interval doubles after each re-measurement, up to this many decisions
PROBE_NEAR_TIE = (
    0.9  # a probe of an option at least this share of the best's rate does not double the interval
)
PROBE_SURPRISE = 0.2  # a probe's time this far from the estimate restarts the bucket's probe back-off
SWITCH_HORIZON = 16  # speculative steps over which entering speculation (one draftless step) must pay
# Consecutive steps of a re-measurement of plain: the first leaves speculation (timed as a switch step), the second
# is not launched ahead of it and is no plain sample (SpeculationPolicy.observe), the third is a steady plain step.
# With 2 (before session 44) plain was re-measured only by steps after an exit: H100, session 44, HumanEval b=64, a
# warm-up profile that timed plain at 2.40 ms (other processes: 1.14) was never corrected (probes' plain steps
# 2.2-2.75 ms against the plain engine's 1.27), and auto speculated in ~3/4 of its b=64 steps at 0.90x of plain.
PROBE_STEPS = 3
# Whether plain decoding is re-measured by probes however far below the best its estimate is (other options only
# within PROBE_WITHIN; the probe budget and the doubling intervals bound what such probes cost). A plain estimate
# measured 2x too slow (session 44's warm-up profile above) otherwise locked plain out of its bucket for good.
ALWAYS_PROBE_PLAIN = True
# A decision whose best option's expected rate is at least HOLD_MARGIN times the runner-up's is held for the next
# HOLD_STEPS - 1 decisions of the same batch (same size, no prompt joining, none past a due probe) without ranking
# the options again - a decision for plain decoding at any batch size (HOLD_PLAIN_FROM), a speculative one from
# HOLD_FROM sequences on. A ranking (every request's MAL estimate, each option's step times) cost ~0.04-0.06 ms of
# host time at b=1 and ~0.06-0.13 ms at b=64 on a 2-core AMD EPYC (session 45, instant executor); on an H100 host
# `auto`'s plain steps at b=1 carried ~0.09 ms more host work than the plain engine's (0.19 against 0.10 ms; wall
# p50 0.52 against 0.45). bench.policy_replay, b = 1-8, 4 seeds, 0.07 ms per ranking: mean auto / best 0.905 ->
# 0.960 holding plain decisions (MT-Bench / HumanEval b=1 0.87 -> 0.97-0.98); without a ranking cost 0.9845 ->
# 0.9831. Holding speculative ones below 16 too: 0.960 -> 0.965 with the cost, 0.4% lower without it (each
# request's estimate matters more in a small batch), so not. HOLD_STEPS 1 = rank before every step.
HOLD_STEPS = 8
HOLD_MARGIN = 1.1
HOLD_FROM = 16
HOLD_PLAIN_FROM = 1
# A held plain decision also holds across steps in which prompts join and while the batch stays in its bucket.
# bench.policy_replay, b = 16-64, 4 seeds x 3 datasets (bench/results/cpu-2026-12-07-s47/): mean auto / best
# 0.9805 -> 0.9788 as decisions alone, 0.9571 -> 0.9612 with each ranking priced at 0.07 ms of host time (b=64
# HumanEval / MT-Bench +1.7%). Off until a device A/B.
HOLD_PLAIN_ACROSS_JOINS = False
PLAUSIBLE = 0.85  # options whose expected rate is at least this share of the best are worth measuring
PROBE_WITHIN = 0.5  # the runner-up is re-measured while its estimate is at least this share of the best
PROBE_BUDGET = 0.01  # expected throughput a bucket's probes may cost (share of the best mode's); 0 = no limit
EMA = 0.2  # weight of the newest sample in acceptance and per-request MAL moving averages
# Step times per (mode, bucket) whose median is the estimate. Its median outlasts slow spells of up to 15 steps:
# H100, session 42, batch 1, HumanEval: spells of 3-17 plain steps at ~1-3.9 ms instead of 0.47 (~1 per 1,000
# steps, in the plain engine's own logs as in auto's; host or device hiccups that slow every mode). With 15, a spell
# of 8 steps moved plain's median; auto then entered speculation and stayed STALE_AFTER decisions, 14 stretches
# at MAL ~2.1 (~0.75 ms per token), 4-6% under plain. bench.policy_replay with such spells (--spells 0.001,8,2,
# session 33's traces, session 42's H100 times, 6 seeds): HumanEval b=1 auto / plain 0.969 (15) -> 0.987 (31);
# without spells GSM8K / MT-Bench b = 1, 8, 64 unchanged or up to +0.01.
STAT_WINDOW = 31
LONG_WINDOW = 256  # step times per (mode, bucket) whose median a stale estimate falls back to
# Weight of the newest decision in a bucket's share of steps with joining prompts (policy.join_share); 0: join
# steps are not priced (the policy before session 43: decode-step times only).
JOIN_EMA = 1 / 64
# Whether a step leaving speculation is priced together with the plain step after it (not launched ahead of the
# exit step's result: H100, session 43, 1.3-2.1 ms at b = 16-64 against 0.9-1.2 steady; SpeculationPolicy.observe).
# Off: session 44's H100 A/B (one spec_bench process per setting, b = 16 / 32 / 64, 3 rounds, paired medians over
# plain) had auto at 0.97 / 0.89 / 0.92 (GSM8K) and 0.95 / 0.93 / 0.72 (HumanEval) with it, 1.05 / 1.16 / 0.99 and
# 0.84 / 0.92 / 0.85 without (behind at 4 of 6 points, mean 0.90 vs 0.97; not significant with one process per
# setting, but the only device evidence; bench.policy_replay, which does not model that step, was neutral).
PRICE_EXIT_FOLLOWER = False
STALE_AFTER = 32  # decisions without a new step time after which a mode's estimate is stale
MIN_PRIOR_VERIFICATIONS = (
    8  # real verifications before G is trusted; until then speculation is assumed to pay
)
PROBE_VERIFICATIONS = 2  # verifying steps of a probe of a speculative mode (after its draftless first step)
REQUEST_PRIOR_WEIGHT = 32  # verifications of a request at which its own evidence weighs half (the c above)
SPEC_MARGIN = 1.05  # speculation is chosen over plain decoding only if its expected rate is this much higher
PRIOR_WINDOW = 128  # verifications (all requests) behind the prior MAL: ~3 GSM8K requests at batch 1
STALE_HALF_LIFE = 8  # plain steps (= emitted tokens) that halve the weight of a request's own MAL estimate
STALE_KEEP = 0.5 ** (1 / STALE_HALF_LIFE)  # per plain step: ~0.917
PRIOR_HALF_LIFE = 128  # plain steps without a verification that halve the weight of G's evidence
PRIOR_KEEP = 0.5 ** (1 / PRIOR_HALF_LIFE)
PRIOR_MIN_WEIGHT = 32.0  # aging never takes G's evidence below this many verifications (16: probes' noise)
SWITCH_MAX = 3.0  # a switch step is priced at most this many steady speculative steps (see switch_costs)
# Whether speculation may start (from plain decoding) in a step where prompts join a decoding batch. Such a
# step drafts for every sequence outside the captured verification tail (a mixed prompt + decode layout runs
# the device-side step eagerly) and writes the context plain steps left: H100, session 40's records,
# speculative steps with a prompt 2.9-6.2 ms at b=16-64 against 1.0-1.5 ms for the plain engine's steps with a
# prompt, and the policy, which times pure decode steps only, never sees them. Joining requests also start
# from the prior G, so the batch's estimate jumps at exactly those steps. False: such a step stays plain
# (reason "join"); speculation can start at the next pure decode step. Neutral in bench.policy_replay (session
# 33's traces, session 39's H100 times, 4 seeds: mean auto / best 0.9856 vs 0.9861) and on the H100 (session 42,
# HumanEval / MT-Bench b = 16-64, 2 rounds: auto's time 6,702 vs 6,723 ms; fewer speculative steps with a joining
# prompt at b=64, more at b = 16-32, where prompts then joined a batch that had started speculating), so the
# default stays True.
ENTER_AT_JOIN = True
