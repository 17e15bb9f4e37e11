"""What drafts are worth, for the speculation policy (:mod:`flexspec.spec.policy`): each request's estimated MAL
(mean accepted drafts + 1 per verification), the population's prior, the per-position acceptance, and what a
chain cut to L drafts emits. The policy divides these by measured step times.

E[tokens per step] of a batch is the mean over its requests of each request's estimated MAL. A request's MAL
estimate:

* the prior G is the population's: the mean of accepted + 1 over the last ~``PRIOR_WINDOW`` verifications of
  all requests; a request not verified yet uses G. Until ``MIN_PRIOR_VERIFICATIONS`` verifications G is
  optimistic (1 + k: every draft accepted), so a fresh engine speculates until it knows what drafts are worth
  here (the warm-up profile's dummy prompt does not set G, see ``SpeculationPolicy.finish_profile``): G is learnt only from
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
Without the decay a request stuck on plain was re-tested only by the runner-up probe (:mod:`flexspec.spec.policy`), and at batch 1
``auto`` trailed always-``decoupled`` (issue 6). Without c (c = 1), once plain steps got cheaper (async
scheduling, session 12: plain 0.77 ms, decoupled 1.73 ms per step at batch 1, break-even MAL 2.25 x
``SPEC_MARGIN``), three rejected verifications in a row (EMA 0.2: r 3 -> 2.28) sent a GSM8K request (G ~3) to
plain: 51% of the batch-1 steps were plain and ``auto`` reached 0.84 of always-``decoupled``. With c weighing
half at 8 verifications (session 13) GSM8K requests still left speculation on noise (H200, batch 1: 54% of the
steps plain, ``auto`` 0.85 of always-``decoupled``); ``bench.policy_replay`` over the shipped DFlash drafter's
acceptance traces (GSM8K, MT-Bench, HumanEval, b = 1-64, H200 step times) put the worst point of ``auto``
against the best fixed mode at 0.955 with (8, ``PRIOR_WINDOW`` 256), 0.966 with (32, 256) and 0.976 with
(32, 128): a shorter prior window also lets G follow a change of workload (GSM8K -> MT-Bench) sooner.

Draft lengths (``decoupled/L`` options of :mod:`flexspec.spec.policy`): a cut chain's E[tokens per step] comes
from the batch's full-length estimate m and the per-position acceptance a_i: 1 + (m - 1) sum_{i<L} a_i / sum_{i<K}
a_i (``option_tokens``); estimates stay full-length ones: a cut chain accepted whole counts what full length would
have accepted past the cut on average (``tail_tokens``), and positions past the cut keep their statistics (not
drafted is not rejected).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flexspec.engine.scheduler import SchedulerOutput
from flexspec.spec import policy_tuning as tuning

__all__ = ["MALEstimates"]


@dataclass(kw_only=True)
class MALEstimates:
    """The acceptance side of :class:`~flexspec.spec.policy.SpeculationPolicy` (a base class of it). Needs
    ``spec`` (the speculative config) and ``lengths`` (option -> most drafts) from the policy."""

    acceptance: list[float] = field(default_factory=list)  # per-position acceptance (EMA over steps)
    prior_tokens_per_step: float | None = None  # G: mean accepted + 1 over ~PRIOR_WINDOW verifications
    num_verifications: int = 0  # of all requests (MIN_PRIOR_VERIFICATIONS)
    prior_weight: float = 0.0  # verifications G stands for: + 1 per verification up to PRIOR_WINDOW, aged
    # the most drafts one step can accept: num_speculative_tokens for chains, a draft tree's depth limit when the
    # engine knows its drafter's (in-process: ``Drafter.max_chain_drafts``); bounds the prior and the warm-up
    max_chain_drafts: int = 0

    def expected_tokens_per_step(self, mode: str) -> float:
        """E[emitted tokens per sequence per step] over all requests seen (the running per-position statistics;
        ``mode`` an option: a "decoupled/L" chain counts its first L positions)."""
        if mode == "plain":
            return 1.0
        return 1.0 + sum(self.acceptance[: self.lengths.get(mode, self.spec.num_speculative_tokens)])

    def option_tokens(self, option: str, spec_tokens: float) -> float:
        """E[tokens per step] of ``option`` for a batch whose full-length estimate is ``spec_tokens`` (m):
        plain decoding 1; a chain cut to L drafts 1 + (m - 1) s(L), s(L) the share of the accepted drafts
        that fall in the first L positions (the per-position acceptance, EMA; before any verification every
        draft is taken as accepted, s = L / K); the full length and parallel execution m."""
        n = self.lengths.get(option, 0)
        if option == "plain":
            return 1.0
        k = self.max_chain_drafts
        if n >= k:
            return spec_tokens
        acc = self.acceptance
        total = sum(acc[:k])
        share = sum(acc[:n]) / total if total > 0 else n / k
        return 1.0 + (spec_tokens - 1.0) * share

    def tail_tokens(self, n: int) -> float:
        """E[drafts accepted past position ``n`` | the first ``n`` were], from the per-position acceptance (a
        chain's draft i is accepted only if every one before it was, so P(reach n) = acceptance[n - 1]): what a
        verification cut to ``n`` drafts that accepted them all would have accepted more at full length.
        0 without statistics for those positions."""
        acc = self.acceptance
        if n < 1 or len(acc) <= n or acc[n - 1] <= 0:
            return 0.0
        return sum(acc[n : self.max_chain_drafts]) / acc[n - 1]

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

    def age_requests(self, seqs) -> None:
        """Requests that emitted a token without verifying drafts (a plain step): their own MAL evidence weighs
        ``STALE_KEEP`` times less against the prior (see the module doc). One call per step for all of them
        (at batch 64 a call per request was ~0.3 us each of the step's host time)."""
        keep = tuning.STALE_KEEP
        for seq in seqs:
            seq.spec_estimate_weight *= keep

    def observe_request(
        self, seq, num_draft_tokens: int, num_accepted: int, draft_length: int | None = None
    ) -> None:
        """Update one request's MAL estimate after a step that emitted tokens for it, having verified
        ``num_draft_tokens`` drafts (0: a plain step, whose only effect is to age the request's own evidence),
        and the prior G after a verification. Called once per emitting step and request, by the engine only
        (the decision is made there and broadcast to every rank). Estimates are of full-length steps: drafts
        cut to ``draft_length`` (the policy's chain length when they were proposed) that were all accepted
        count what full length would have accepted on average past the cut (``tail_tokens``); a rejection
        before the cut is where full length would have stopped too."""
        if num_draft_tokens == 0:
            self.age_requests((seq,))
            return
        tokens = num_accepted + 1.0
        if num_accepted == num_draft_tokens == draft_length and draft_length < self.max_chain_drafts:
            tokens += self.tail_tokens(draft_length)
        self.num_verifications += 1
        self.prior_weight = min(self.prior_weight + 1.0, tuning.PRIOR_WINDOW)
        g = self.prior_tokens_per_step
        g = tokens if g is None else g + (tokens - g) / self.prior_weight
        self.prior_tokens_per_step = g
        prev = seq.spec_tokens_per_step
        seq.spec_tokens_per_step = (1 - tuning.EMA) * (g if prev is None else prev) + tuning.EMA * tokens
        seq.spec_estimate_weight = 1.0
        seq.spec_num_verifications = getattr(seq, "spec_num_verifications", 0) + 1

    def observe_acceptance(
        self, mode: str, per_position_acceptance: list[float] | None, verified_length: int | None = None
    ) -> None:
        """One step's per-position acceptance (``SpeculationPolicy.observe``): an EMA per position; a plain
        step that verified nothing ages G's evidence (``PRIOR_HALF_LIFE``). Positions with no draft count as
        not accepted (0), except past ``verified_length`` (the most drafts the option that drafted them
        allowed): those were cut by the policy's choice of length, so they keep their statistics."""
        if not per_position_acceptance:
            if mode == "plain" and self.prior_weight > tuning.PRIOR_MIN_WEIGHT:
                self.prior_weight = max(self.prior_weight * tuning.PRIOR_KEEP, tuning.PRIOR_MIN_WEIGHT)
            return
        acc, step = self.acceptance, list(per_position_acceptance)
        upto = max(len(acc), len(step))
        if verified_length is not None:
            upto = max(min(verified_length, upto), len(step))
        step += [0.0] * (upto - len(step))
        if not acc:
            self.acceptance = step
            return
        acc = acc + [0.0] * (upto - len(acc))
        for i in range(upto):
            acc[i] = (1 - tuning.EMA) * acc[i] + tuning.EMA * step[i]
        self.acceptance = acc
