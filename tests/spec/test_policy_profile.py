"""Warm-up profile of the per-batch policy (issue 6: "step times measured online, warm-up profile at start"):
the engine times each execution mode at each batch-size bucket on dummy requests before serving, the policy
starts from those medians, and nothing of the dummy requests leaks into the engine's state or outputs."""

from __future__ import annotations

import itertools
import random

from configs import SamplingParams
from flexspec.spec import warmup
from flexspec.spec.policy_tuning import WARMUP_SAMPLES
from flexspec.spec.warmup import _rounds
from tests.spec.conftest import spec_engine


def test_profile_fills_every_mode_and_bucket_and_leaves_no_trace(plain_128):
    prompts, want = plain_128
    prompts, want = prompts[2::6], [w[:32] for w in want[2::6]]
    spec = {"method": "dflash", "model": "smollm2-135m-instruct-dflash", "num_speculative_tokens": 3}
    eng = spec_engine(spec, max_num_seqs=2, speculation_profile_steps=3)
    pol = eng.policy
    steady = {"plain@1", "decoupled@1", "plain@2", "decoupled@2"}
    switches = {
        f"{k}:decoupled@{b}" for k in ("enter", "exit") for b in (1, 2)
    }  # SpeculationPolicy.switch_time
    assert set(eng.speculation_profile) == steady | switches
    assert all(ms > 0 for ms in eng.speculation_profile.values())
    for key, ms in eng.speculation_profile.items():
        mode, bucket = key.split("@")
        stat = pol.step_times[(mode, int(bucket))]
        assert stat.n >= 1 and abs(stat.seconds * 1e3 - ms) < 1e-3
    # the dummy requests left nothing behind: no requests, free KV cache, fresh counters and seed stream
    assert not eng.has_unfinished and not eng.seqs and eng.block_manager.usage == 0.0
    assert eng.stats.num_steps == 0 and eng.stats.num_generation_tokens == 0
    assert eng.spec_metrics.num_draft_tokens == 0 and pol.mode_counts == {}
    # the dummy requests' acceptance is dropped: serving starts from the optimistic prior (all drafts accepted)
    assert pol.prior_tokens_per_step is None and pol.num_verifications == 0 and pol.acceptance == []
    assert pol.prior() == 1 + spec["num_speculative_tokens"]
    assert eng._rng.getstate() == random.Random(eng.config.seed).getstate()
    # no warm-up exploration is needed after the profile: the policy decides from the profiled times
    assert all(pol.samples(m) >= WARMUP_SAMPLES for m in pol.options)
    outs = eng.generate(prompts, SamplingParams(max_tokens=32, temperature=0))
    assert [o.token_ids for o in outs] == want


def test_profile_off_on_cpu_by_default():
    eng = spec_engine({"method": "ngram", "num_speculative_tokens": 2})
    assert eng.speculation_profile == {} and eng.policy.step_times == {}


def test_profile_rounds_time_both_switch_steps_of_every_mode_from_fresh_requests():
    """FlexDraft's modes: plain -> decoupled -> parallel left decoupled -> parallel, a switch the policy does
    not time, so neither mode had both switch steps measured. Each speculative mode gets a round of its own
    (fresh requests: the same context lengths for every mode), entered from plain decoding and left to it."""
    rounds = _rounds(["plain", "decoupled", "parallel"], 3)
    assert rounds == [
        [("plain", 5), ("decoupled", 5), ("plain", 1)],
        [("plain", 1), ("parallel", 5), ("plain", 1)],
    ]
    pairs = set()
    for phases in rounds:
        modes = [m for m, n in phases for _ in range(n)]
        pairs |= {(a, b) for a, b in itertools.pairwise(modes) if a != b}
    assert pairs == {
        ("plain", "decoupled"),
        ("decoupled", "plain"),
        ("plain", "parallel"),
        ("parallel", "plain"),
    }


def test_profile_steps_verify_about_as_many_drafts_as_each_length_allows(monkeypatch):
    """Session 36, H100: the profile's drafts were cut short by selective verification, so chains of 3, 7 and
    15 drafts all timed the same (2.82-2.87 ms at batch 64) where GSM8K steps take 2.42 / 2.81 / 3.30 ms. The
    profile's steps now keep every draft their option allows (device-side steps, as this CPU runs them) from
    ``FULL_DRAFTS_FROM`` requests on, and not below (a lone request's step is as long as its confident prefix)."""
    spec = {"method": "dflash", "model": "smollm2-135m-instruct-dflash", "execution": "auto"}
    eng = spec_engine(spec, max_num_seqs=1, speculation_profile_steps=0)
    pol = eng.policy
    assert pol.options == ["plain", "decoupled/3", "decoupled/7", "decoupled"]
    verified: dict[int, list[int]] = {}  # draft length -> drafts verified per verification
    observe_request = pol.observe_request

    def recorded(seq, num_draft_tokens, num_accepted, draft_length=None):
        if num_draft_tokens:
            verified.setdefault(draft_length, []).append(num_draft_tokens)
        observe_request(seq, num_draft_tokens, num_accepted, draft_length)

    pol.observe_request = recorded
    monkeypatch.setattr(warmup, "FULL_DRAFTS_FROM", 1)  # uncut drafts from batch 1 on (16 on the GPU)
    profile = eng.profile_speculation(3)
    assert {"decoupled/3@1", "decoupled/7@1", "decoupled@1"} <= set(profile)
    assert set(verified) == {3, 7, 15}
    for length, counts in verified.items():
        assert sum(counts) / len(counts) >= 0.9 * length, (length, counts)
    verified.clear()
    monkeypatch.setattr(warmup, "FULL_DRAFTS_FROM", 2)
    eng.profile_speculation(3)
    assert sum(verified[15]) / len(verified[15]) < 0.6 * 15, verified  # batch 1: cut by confidence
