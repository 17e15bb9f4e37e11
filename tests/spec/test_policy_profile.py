"""Warm-up profile of the per-batch policy (issue 6: "step times measured online, warm-up profile at start"):
the engine times each execution mode at each batch-size bucket on dummy requests before serving, the policy
starts from those medians, and nothing of the dummy requests leaks into the engine's state or outputs."""

from __future__ import annotations

import itertools
import random

from configs import SamplingParams
from flexspec.spec.policy_tuning import WARMUP_SAMPLES
from flexspec.spec.warmup import _phases
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


def test_profile_phases_time_both_switch_steps_of_every_mode():
    """FlexDraft's modes: plain -> decoupled -> parallel left decoupled -> parallel, a switch the policy does
    not time, so neither mode had both switch steps measured. A plain step after each speculative mode times
    leaving it, and the next one is entered from plain decoding."""
    phases = _phases(["plain", "decoupled", "parallel"], 3)
    assert phases == [("plain", 5), ("decoupled", 5), ("plain", 1), ("parallel", 5), ("plain", 1)]
    modes = [m for m, n in phases for _ in range(n)]
    pairs = {(a, b) for a, b in itertools.pairwise(modes) if a != b}
    assert pairs == {
        ("plain", "decoupled"),
        ("decoupled", "plain"),
        ("plain", "parallel"),
        ("parallel", "plain"),
    }
