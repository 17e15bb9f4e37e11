"""Steps in which prompts join a decoding batch (``SchedulerOutput.num_prefills``): ``policy_tuning.ENTER_AT_JOIN``
(whether speculation may start in one) and their step times (``SpeculationPolicy.mean_step_time``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flexspec.spec import policy_tuning
from flexspec.spec.policy_tuning import JOIN_EMA, WARMUP_SAMPLES
from tests.spec.test_policy import _policy, _sched, _train


def test_speculation_starts_at_a_step_where_prompts_join_only_if_enter_at_join(monkeypatch):
    """ENTER_AT_JOIN off: a step in which prompts join a decoding batch stays plain after plain decoding (reason
    "join"); the next pure decode step speculates; a step of prompts only, or one already speculating, is
    decided as before. On (the default): the join step speculates as any other."""
    times = {"plain": 1.0, "decoupled": 1.5, "parallel": 1.2}
    join = SimpleNamespace(scheduled=[object()] * 4, preempted=[], num_prefills=1)  # 1 prompt joins 3 decodes
    prompts_only = SimpleNamespace(scheduled=[object()] * 4, preempted=[], num_prefills=4)
    pure = SimpleNamespace(scheduled=[object()] * 4, preempted=[], num_prefills=0)
    for enter_at_join in (False, True):
        monkeypatch.setattr(policy_tuning, "ENTER_AT_JOIN", True)  # _sched's stand-ins have no token counts
        pol = _policy()
        _train(pol, 4, times, [0.9, 0.8, 0.7, 0.6])
        assert pol.decide(_sched(4)).mode == "parallel"
        monkeypatch.setattr(policy_tuning, "ENTER_AT_JOIN", enter_at_join)
        pol.last_modes = ["plain", "plain"]  # as after a plain stretch
        d = pol.decide(join)
        if enter_at_join:
            assert (d.mode, d.reason) == ("parallel", "best")
            continue
        assert (d.mode, d.reason, pol.last_reason) == ("plain", "join", "join")
        assert pol.decide(pure).mode == "parallel"  # the next pure decode step enters
        assert pol.decide(join).mode == "parallel"  # already speculating: the join step goes on
        pol.last_modes = ["plain", "plain"]
        assert pol.decide(prompts_only).mode == "parallel"  # no decoding batch to keep plain


def test_steps_that_prefill_a_prompt_are_timed_apart():
    """Regression (H200 spec bench with request turnover): a step that also prefilled a prompt (~15 ms against
    ~1.5 ms) was timed as its mode's decode step and locked that mode out. Each step reaches the policy with its
    time, flagged ``prefill`` exactly when it prefills (a join step's time, never the mode's decode time)."""
    from configs import SamplingParams
    from tests.spec.conftest import spec_engine

    eng = spec_engine({"method": "ngram", "num_speculative_tokens": 3, "execution": "auto"}, max_num_seqs=4)
    ex, pol = eng.executor, eng.policy
    execute, launch, observe = ex.execute, ex.launch, pol.observe
    kinds: list[str] = []  # per step, in order: "prefill" | "decode"
    flagged: list[str] = []  # per observed step, in order: how it reached the policy

    def classified(fn):
        def wrapper(inp):
            drafts = inp.num_draft_tokens or [0] * len(inp.query_lens)
            kinds.append("prefill" if any(q > d + 1 for q, d in zip(inp.query_lens, drafts)) else "decode")
            return fn(inp)

        return wrapper

    def observed(mode, n, seconds, acceptance, previous=None, **kw):
        assert seconds is not None and seconds > 0
        flagged.append("prefill" if kw.get("prefill") else "decode")
        observe(mode, n, seconds, acceptance, previous, **kw)

    ex.execute, ex.launch, pol.observe = classified(execute), classified(launch), observed
    params = SamplingParams(max_tokens=12, temperature=0)
    prompts = [
        eng.apply_chat_template([{"role": "user", "content": f"Name {i + 2} colours."}]) for i in range(6)
    ]
    for p in prompts[:2]:
        eng.add_request(p, params)
    late = iter(prompts[2:])
    while eng.has_unfinished:
        eng.step()
        if eng.stats.num_steps % 3 == 0:  # new requests join a running batch: mixed prefill + decode steps
            nxt = next(late, None)
            if nxt is not None:
                eng.add_request(nxt, params)
    assert kinds.count("prefill") >= 4 and len(flagged) == len(kinds)  # every step emitted, so was observed
    assert flagged == kinds


def _join(n: int, prompts: int) -> SimpleNamespace:
    return SimpleNamespace(scheduled=[object()] * n, preempted=[], num_prefills=prompts)


def test_join_steps_are_timed_per_mode_and_priced_at_their_share():
    """A step with a joining prompt is timed as its mode's join step (when the mode ran the step before too),
    never as the mode's decode step; the expected step time mixes both at the bucket's share of join steps."""
    pol = _policy(execution="auto")
    _train(pol, 4, {"plain": 1.0, "decoupled": 1.5, "parallel": 1.2}, [0.9, 0.8, 0.7, 0.6])
    decode = {m: pol.step_time(m, 4) for m in ("plain", "decoupled")}
    pol.observe(
        "decoupled", 4, 9.0, None, previous="plain", prefill=True
    )  # switching: not a join step's time
    assert pol.step_time("join:decoupled", 4) is None
    for _ in range(3):
        pol.observe("decoupled", 4, 6.0, None, previous="decoupled", prefill=True)
        pol.observe("plain", 4, 2.0, None, previous="plain", prefill=True)
    assert {m: pol.step_time(m, 4) for m in decode} == decode  # decode estimates untouched
    assert pol.step_time("join:decoupled", 4) == 6.0 and pol.step_time("join:plain", 4) == 2.0
    assert pol.mean_step_time("decoupled", 4) == decode["decoupled"]  # no joins seen yet: share 0
    for _ in range(200):  # every other step has a joining prompt
        pol.decide(_join(4, 1)), pol.decide(_join(4, 0))
    p = pol.join_share[4]
    assert p == pytest.approx(0.5, abs=2 * JOIN_EMA)
    assert pol.mean_step_time("decoupled", 4) == pytest.approx((1 - p) * 1.5 + p * 6.0)
    # a mode whose join steps were never timed pays plain's extra for a prompt
    assert pol.mean_step_time("parallel", 4) == pytest.approx((1 - p) * 1.2 + p * (1.2 + 2.0 - 1.0))


def test_costly_join_steps_keep_a_batch_with_turnover_on_plain_decoding():
    """H100, session 42, MT-Bench b=64: speculative steps with a joining prompt cost 3.3-3.9 ms against 1.3 for
    plain ones, and a prompt joins in most steps; decode steps alone (2.0 against 1.1 ms) made chains of 3
    drafts at MAL ~2.1 look better than plain decoding. With join steps priced, plain decoding wins."""
    pol = _policy(execution="auto", method="dflash", num_speculative_tokens=3)
    times = {"plain": 1.1, "decoupled": 2.0}
    acceptance = [0.6, 0.4, 0.2]  # E[tokens per step] 2.2: 2.2 / 2.0 beats 1.05 / 1.1 on decode steps
    _train(pol, 64, times, acceptance)
    assert pol.decide(_sched(64)).mode == "decoupled"
    for _ in range(WARMUP_SAMPLES):
        pol.observe("decoupled", 64, 3.6, None, previous="decoupled", prefill=True)
        pol.observe("plain", 64, 1.3, None, previous="plain", prefill=True)
    modes = [pol.decide(_join(64, i % 4 != 0)).mode for i in range(400)]  # 3 steps in 4 have a joining prompt
    assert modes[-100:].count("plain") >= 95
