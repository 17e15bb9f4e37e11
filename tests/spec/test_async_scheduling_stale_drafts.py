"""Async scheduling (found by a review): a plain step scheduled ahead in a speculative engine sees drafts that the step in flight makes stale.

A request D holds drafts from a speculative step, but the next step (plain) gives it none because the token
budget ran out before it (requests ahead of it in the running list had no drafts). That plain step is in
flight when the next one is scheduled ahead on top of it: D's stale ``draft_token_ids`` are still set (the
step's collect clears them only later), so if budget frees up (here: a request aborted between steps), the
scheduler grants D draft tokens. The batch then is not eligible to launch ahead, so ``_step_after`` builds it
after the collect, which has reset D.draft_token_ids = [] -> the ScheduledSequence asks for 2 tokens, its
token_ids has 1: input ids and positions disagree.
"""

from __future__ import annotations

from configs import SamplingParams
from flexspec.spec.policy import Decision
from tests.spec.conftest import on_worker_outputs, spec_engine


def _run(ahead: bool):
    eng = spec_engine(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
        max_num_seqs=4,
        max_num_batched_tokens=4,
    )
    eng.config.async_scheduling = ahead
    state = {"mode": "plain", "spec_steps": 0, "aborted": False}

    def decide(sched):
        if state["mode"] == "decoupled":
            state["mode"] = "plain"
            return Decision("decoupled", 3)
        return Decision("plain", 0)

    eng.policy.decide = decide
    worker = eng.executor.runner.spec_worker
    rids = [
        eng.add_request(
            [1, 2, 3 + i], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), request_id=f"r{i}"
        )
        for i in range(4)
    ]
    seqs = {r: eng.seqs[r] for r in rids}
    last = seqs["r3"]

    def inject(inp, out):
        # drafts for the last request only (an n-gram drafter finds a match for some requests, not others)
        if inp.num_speculative_tokens:
            emit = [sid for sid, s in zip(inp.seq_ids, inp.samples) if s]
            out.draft_token_ids = [[5, 6, 7] if sid == last.seq_id else [] for sid in emit]
            state["spec_steps"] += 1

    final = {}
    with on_worker_outputs(worker, inject):
        for step in range(300):
            if step == 12:
                assert all(s.num_output_tokens for s in seqs.values())  # all decoding
                state["mode"] = "decoupled"
            if (
                state["spec_steps"]
                and not state["aborted"]
                and eng._inflight is not None
                and last.draft_token_ids
                and not any(eng._inflight.inp.num_draft_tokens)
            ):
                eng.abort("r0")  # frees budget for the step scheduled ahead of the plain step in flight
                state["aborted"] = True
            for o in eng.step():
                if o.finished:
                    final[o.request_id] = o.token_ids
            if not eng.has_unfinished:
                break
    assert state["aborted"]
    return final, eng.block_manager.usage


def test_stale_drafts_scheduled_ahead():
    sync, _ = _run(False)
    ahead, usage = _run(True)  # raises / differs on the buggy engine
    assert ahead == sync
    assert usage == 0.0
