"""The policy's per-batch draft length (issue 6: "choose {parallel(len), decoupled(len), plain}"): chains cut
to 3 / 7 drafts are options of ``execution: auto`` next to the full length, priced from the per-position
acceptance and their own measured step times."""

from __future__ import annotations

import pydantic
import pytest

from configs import EngineConfig
from configs.speculative import parse_speculative_config
from flexspec.engine.scheduler import SchedulerOutput
from flexspec.spec.policy import SpeculationPolicy
from flexspec.spec.policy_tuning import EMA, PRIOR_WINDOW, WARMUP_SAMPLES

# Session 36, H100, shipped DFlash drafter, GSM8K (and MT-Bench): per-position acceptance of always-decoupled
# k=15, and GSM8K's median
# decode-step times (ms) of fixed chains of 3 / 7 / 15 drafts and plain decoding at batch 1 and 64
# (bench/results/h100-2026-12-06-s36/lengths-gsm8k).
GSM8K_ACCEPTANCE = [
    0.73,
    0.52,
    0.37,
    0.25,
    0.15,
    0.10,
    0.056,
    0.026,
    0.013,
    0.0035,
    0.0026,
    0.0026,
    0.0026,
    0.0026,
]
MT_BENCH_ACCEPTANCE = [0.48, 0.23, 0.11, 0.063, 0.032, 0.02, 0.008, 0.0045, 0.0022, 0.0005]
STEP_MS = {
    1: {"plain": 0.456, "decoupled/3": 1.327, "decoupled/7": 1.339, "decoupled": 1.353},
    64: {"plain": 1.163, "decoupled/3": 2.417, "decoupled/7": 2.814, "decoupled": 3.303},
}


class _Seq:
    spec_tokens_per_step = None
    spec_num_verifications = 0
    spec_estimate_weight = 1.0


class _Scheduled:
    def __init__(self, seq):
        self.seq = seq


def _sched(seqs) -> SchedulerOutput:
    return SchedulerOutput(scheduled=[_Scheduled(s) for s in seqs], preempted=[])


def _dflash_policy(**spec) -> SpeculationPolicy:
    sc = {"method": "dflash", "model": "unused", "execution": "auto", **spec}
    return SpeculationPolicy(EngineConfig(speculative_config=sc))


def test_default_lengths_halve_down_to_3_and_config_errors_name_the_field():
    assert parse_speculative_config({"method": "dflash", "model": "x"}).policy_draft_lengths() == [3, 7, 15]
    assert parse_speculative_config(
        {"method": "ngram", "num_speculative_tokens": 5}
    ).policy_draft_lengths() == [5]
    spec = {"method": "dflash", "model": "x", "draft_lengths": [15, 1, 1]}
    assert parse_speculative_config(spec).policy_draft_lengths() == [1, 15]
    with pytest.raises(pydantic.ValidationError, match="draft_lengths"):
        parse_speculative_config({"method": "dflash", "model": "x", "draft_lengths": [16]})
    with pytest.raises(pydantic.ValidationError, match="draft_lengths"):
        parse_speculative_config({"method": "dflash", "model": "x", "draft_lengths": []})
    for bad in ([True], [3.0], ["3"]):  # strict: no quiet conversion to 1 / 3
        with pytest.raises(pydantic.ValidationError, match=r"draft_lengths\.0"):
            parse_speculative_config({"method": "dflash", "model": "x", "draft_lengths": bad})
    for unused in ({"execution": "decoupled"}, {"draft_tree_topk": 4}):  # settings that would be ignored
        with pytest.raises(pydantic.ValidationError, match="draft_lengths"):
            parse_speculative_config({"method": "dflash", "model": "x", "draft_lengths": [3], **unused})
    with pytest.raises(pydantic.ValidationError, match="^1 validation error for speculative_config"):
        parse_speculative_config({"method": "dflash", "model": "x", "draft_lengths": [16]})
    assert _dflash_policy().options == ["plain", "decoupled/3", "decoupled/7", "decoupled"]
    assert _dflash_policy(draft_tree_topk=4).options == ["plain", "decoupled"]  # trees: full length only
    assert _dflash_policy(execution="decoupled").options == ["plain", "decoupled"]
    assert _dflash_policy(draft_lengths=[15]).options == ["plain", "decoupled"]


def _trained(pol: SpeculationPolicy, mal: float, acceptance: list[float]) -> list[_Seq]:
    """Step times of every option at buckets 1 and 64 (``STEP_MS``), the given per-position acceptance, and
    64 requests whose own estimates, and the prior's, are ``mal``."""
    for bucket, times in STEP_MS.items():
        for option, ms in times.items():
            for _ in range(WARMUP_SAMPLES + 1):
                pol.observe(option, bucket, ms / 1e3, None, previous=option)
    pol.acceptance = list(acceptance)
    pol._warmed = True
    seqs = [_Seq() for _ in range(64)]
    for s in seqs:  # each request verified 40 times (the policy's own updates: test_policy.py)
        s.spec_tokens_per_step, s.spec_num_verifications = mal, 40
    pol.prior_tokens_per_step, pol.num_verifications, pol.prior_weight = mal, 40 * 64, PRIOR_WINDOW
    return seqs


def test_large_batch_takes_a_short_chain_and_batch_one_a_long_one():
    pol = _dflash_policy()
    seqs = _trained(pol, 3.3, GSM8K_ACCEPTANCE)  # GSM8K's MAL at full length
    # b=64: E[tokens] 3.3 (full) / 2.7 (3 drafts) / 3.25 (7 drafts) over 3.30 / 2.42 / 2.81 ms against plain's
    # 1 / 1.16 ms (x SPEC_MARGIN): a chain cut to 7 drafts beats plain decoding and the full length
    d = pol.decide(_sched(seqs))
    assert (d.mode, d.option, d.num_speculative_tokens) == ("decoupled", "decoupled/7", 7)
    pol.last_modes = []  # no hysteresis from the b=64 decision
    d1 = pol.decide(_sched(seqs[:1]))  # b=1: lengths cost the same (1.33-1.35 ms), the longer ones emit more
    assert d1.mode == "decoupled" and d1.num_speculative_tokens >= 7, d1


def test_a_workload_whose_drafts_fail_early_stays_plain_at_large_batch():
    pol = _dflash_policy()
    seqs = _trained(pol, 1.9, MT_BENCH_ACCEPTANCE)  # even 3 drafts: 1.84 tokens / 2.42 ms < 1 / 1.16 ms
    assert pol.decide(_sched(seqs)).option == "plain"


def test_option_tokens_follow_the_per_position_acceptance():
    pol = _dflash_policy()
    assert pol.option_tokens("decoupled/3", 4.0) == pytest.approx(
        1 + 3 * 3 / 15
    )  # no statistics: every draft
    pol.acceptance = list(GSM8K_ACCEPTANCE)
    share = sum(GSM8K_ACCEPTANCE[:3]) / sum(GSM8K_ACCEPTANCE)
    assert pol.option_tokens("decoupled/3", 3.2) == pytest.approx(1 + 2.2 * share)
    assert pol.option_tokens("decoupled", 3.2) == 3.2 and pol.option_tokens("plain", 3.2) == 1.0
    assert pol.expected_tokens_per_step("decoupled/3") == pytest.approx(1 + sum(GSM8K_ACCEPTANCE[:3]))


def test_a_cut_chain_accepted_whole_counts_what_full_length_would_have_accepted():
    pol = _dflash_policy()
    pol.acceptance = list(GSM8K_ACCEPTANCE)
    tail = sum(GSM8K_ACCEPTANCE[3:]) / GSM8K_ACCEPTANCE[2]  # E[accepted past 3 | the first 3 accepted]
    assert pol.tail_tokens(3) == pytest.approx(tail)
    whole, rejected, full = _Seq(), _Seq(), _Seq()
    pol.observe_request(whole, 3, 3, draft_length=3)  # all 3 accepted: full length would have gone on
    assert whole.spec_tokens_per_step == pytest.approx(4 + tail)
    pol.observe_request(rejected, 3, 1, draft_length=3)  # rejected before the cut: the same at full length
    assert rejected.spec_tokens_per_step == pytest.approx(
        (1 - EMA) * pol.prior_tokens_per_step + EMA * 2, rel=0.2
    )
    pol.observe_request(full, 15, 15, draft_length=15)  # nothing past the full length
    assert pol.num_verifications == 3 and full.spec_tokens_per_step <= 16


def test_positions_past_the_policys_cut_keep_their_statistics():
    pol = _dflash_policy()
    pol.observe("decoupled", 4, None, [0.8, 0.6, 0.4, 0.3, 0.2])
    pol.observe("decoupled/3", 4, None, [0.5, 0.25], verified_length=3)  # position 3 had no draft: 0 there
    assert pol.acceptance[:3] == pytest.approx(
        [0.8 * (1 - EMA) + 0.5 * EMA, 0.6 * (1 - EMA) + 0.25 * EMA, 0.4 * (1 - EMA)]
    )
    assert pol.acceptance[3:] == [0.3, 0.2]  # past the cut: not drafted, not rejected
    pol.observe("decoupled", 4, None, [0.5])  # full length: missing positions count as rejected
    assert pol.acceptance[4] == pytest.approx(0.2 * (1 - EMA))


def test_a_step_between_chain_lengths_is_timed_as_the_length_it_verifies():
    pol = _dflash_policy()
    pol.observe("decoupled", 64, 3.3e-3, None, previous="decoupled/3")  # verifies the 3-draft chains
    pol.observe("decoupled/3", 64, 2.4e-3, None, previous="plain")  # entering speculation
    assert pol.step_times[("decoupled/3", 64)].n == 1 and ("decoupled", 64) not in pol.step_times
    assert pol.step_times[("enter:decoupled/3", 64)].n == 1


def test_engine_runs_the_chosen_lengths_exactly(plain_128):
    """Real engine, shipped DFlash drafter, T=0, one batch of 8 real prompts: decisions cycle through
    3-draft chains, full-length chains and plain decoding; every step proposes at most its option's drafts,
    the verifications of cut chains reach the policy with their length, and the output is plain decoding's."""
    from configs import SamplingParams
    from tests.spec.conftest import on_worker_outputs, spec_engine

    prompts, ref = (x[:8] for x in plain_128)  # one batch; the 12-decision pattern cycles several times
    eng = spec_engine(
        {"method": "dflash", "model": "smollm2-135m-instruct-dflash", "execution": "auto"},
        max_num_seqs=8,
        speculation_profile_steps=0,
    )
    pol = eng.policy
    pattern = ["decoupled/3"] * 4 + ["decoupled"] * 3 + ["plain"] * 2 + ["decoupled/7"] * 3
    decisions = iter(range(10**9))
    pol.decide = lambda sched: pol._decision(pattern[next(decisions) % len(pattern)])
    proposed: list[tuple[int, int]] = []  # (drafts allowed, most drafts proposed to one sequence)
    verified: list[tuple[int, int, int | None]] = []  # (drafts, accepted, draft_length) of each verification
    observe_request = pol.observe_request

    def recorded(seq, num_draft_tokens, num_accepted, draft_length=None):
        if num_draft_tokens:
            verified.append((num_draft_tokens, num_accepted, draft_length))
        observe_request(seq, num_draft_tokens, num_accepted, draft_length)

    pol.observe_request = recorded

    def seen(inp, out):
        proposed.append((inp.num_speculative_tokens, max(map(len, out.draft_token_ids or [[]]), default=0)))

    with on_worker_outputs(eng.executor.runner.spec_worker, seen):
        got = [o.token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=128, temperature=0))]
    assert got == ref
    assert all(most <= allowed for allowed, most in proposed), proposed
    assert {allowed for allowed, most in proposed if most} == {3, 7, 15}
    lengths = {length for _, _, length in verified}
    assert lengths == {3, 7, 15}, lengths
    assert all(d <= length for d, _, length in verified)
    assert any(a == d == 3 for d, a, length in verified if length == 3)  # cut chains accepted whole: imputed
    assert {"decoupled/3", "decoupled/7", "decoupled", "plain"} <= set(pol.mode_counts)
    assert any(key[0] == "decoupled/3" for key in pol.step_times)  # timed as its own option


def test_probes_cycle_through_the_plausible_options():
    """With four options, probing only the runner-up left the others' estimates where the warm-up profile set
    them: probes now go to the plausible option measured longest ago, so each one is re-measured in turn."""
    pol = _dflash_policy()
    seqs = _trained(pol, 3.3, GSM8K_ACCEPTANCE)
    decided, prev = [], None
    for _ in range(1000):
        d = pol.decide(_sched(seqs))
        decided.append(d.option)
        ms = STEP_MS[64][prev if prev not in (None, "plain") and d.option != "plain" else d.option]
        pol.observe(d.option, 64, ms / 1e3, None, previous=prev)
        prev = d.option
    best = max(set(decided), key=decided.count)
    assert best == "decoupled/7"
    assert {"decoupled/3", "decoupled"} <= set(decided)  # both other chain lengths were re-measured
