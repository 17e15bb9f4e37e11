"""Async output processing: the engine launches step N+1 before it detokenizes step N (issue 2).

Overlapping must change nothing a user sees: the same tokens, text, streamed deltas, logprobs and finish
reasons as synchronous steps, no step launched past a stop, and an abort while a step is in flight loses only
that request.
"""

from __future__ import annotations

import pytest

from configs import SamplingParams


@pytest.fixture
def sync_mode(engine):
    """Run a block with the shared engine in synchronous mode, then restore overlap."""

    class Mode:
        def __init__(self, overlap: bool) -> None:
            self.overlap = overlap

        def __enter__(self):
            assert not engine.has_unfinished
            engine.config.async_output_processing = self.overlap

        def __exit__(self, *exc):
            engine.config.async_output_processing = True

    return Mode


def chat(engine, text: str) -> list[int]:
    return engine.apply_chat_template([{"role": "user", "content": text}])


def run_streaming(engine, prompts, params):
    """Step to completion; per request: (streamed text, streamed ids, logprob ids, final output)."""
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    seen = {r: ["", [], [], None] for r in rids}
    while engine.has_unfinished:
        for o in engine.step():
            rec = seen[o.request_id]
            rec[0] += o.new_text
            rec[1] += o.new_token_ids
            rec[2] += [(lp.token_id, round(lp.logprob, 4)) for lp in o.new_logprobs or []]
            rec[3] = o
    return [seen[r] for r in rids]


def test_overlapped_steps_match_synchronous_steps(engine, sync_mode):
    assert engine.overlaps_output_processing  # the default for plain decoding in one process
    prompts = [
        chat(engine, "Write a short poem about the sea."),
        chat(engine, "What is 12 times 7? Answer briefly."),
        chat(engine, "List three colours."),
        chat(engine, "Say hello."),
    ]
    params = [
        SamplingParams(max_tokens=40, temperature=0, stop=["wave", "\n\n"]),
        SamplingParams(max_tokens=24, temperature=0, logprobs=2),
        SamplingParams(max_tokens=9, temperature=0.8, seed=7),
        SamplingParams(max_tokens=30, temperature=0),
    ]
    overlapped = run_streaming(engine, prompts, params)
    with sync_mode(False):
        assert not engine.overlaps_output_processing
        synchronous = run_streaming(engine, prompts, params)
    for (text_a, ids_a, lps_a, out_a), (text_b, ids_b, lps_b, out_b) in zip(overlapped, synchronous):
        assert out_a.token_ids == out_b.token_ids and ids_a == out_a.token_ids
        assert text_a == out_a.text == out_b.text == text_b
        assert (out_a.finish_reason, out_a.stop_reason) == (out_b.finish_reason, out_b.stop_reason)
        assert lps_a == lps_b
    assert overlapped[2][3].finish_reason == "length" and len(overlapped[2][3].token_ids) == 9
    assert engine.block_manager.usage == 0.0


def test_no_step_is_launched_past_a_stop(engine):
    launched = []
    orig = engine.executor.launch
    engine.executor.launch = lambda inp: launched.append(inp.num_tokens) or orig(inp)
    try:
        prompt = chat(engine, "Count from one to twenty in words.")
        full = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]
        launched.clear()
        o = engine.generate([prompt], SamplingParams(max_tokens=5, temperature=0))[0]
        assert o.token_ids == full.token_ids[:5]
        assert len(launched) == 5  # the prefill (first token) + 4 decode steps, none after the 5th token
        word = engine.tokenizer.decode(full.token_ids[5:8]).strip().split()[0]
        launched.clear()
        o = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop=[word]))[0]
        assert o.finish_reason == "stop" and o.stop_reason == word
        assert len(launched) == len(o.token_ids)  # one launch per emitted token: stopped before the next
    finally:
        del engine.executor.launch


def test_abort_while_a_step_is_in_flight(engine):
    keep = engine.add_request(chat(engine, "Name a fruit."), SamplingParams(max_tokens=8, temperature=0))
    drop = engine.add_request(chat(engine, "Name a car."), SamplingParams(max_tokens=50, temperature=0))
    outs = engine.step()  # the prefill step: launched and collected; the first decode step is now in flight
    assert engine._inflight is not None
    assert {o.request_id for o in outs} == {keep, drop}
    engine.abort(drop)
    got = {keep: [], drop: []}
    while engine.has_unfinished:
        for o in engine.step():
            got[o.request_id].append(o)
    assert got[drop] == []  # nothing from the aborted request, not even its in-flight token
    assert got[keep][-1].finished and len(got[keep][-1].token_ids) == 8
    assert engine.block_manager.usage == 0.0
    alone = engine.generate([chat(engine, "Name a fruit.")], SamplingParams(max_tokens=8, temperature=0))[0]
    assert alone.token_ids == got[keep][-1].token_ids


def test_aborting_an_earlier_request_in_flight_leaves_the_others_exact(engine):
    """The aborted request's row of the in-flight step must still be consumed; otherwise every later request in
    the batch reads its neighbour's token (found by a fresh-user trial: clients disconnecting mid-stream)."""
    prompts = [
        chat(engine, t)
        for t in ("Tell me about dragons.", "Write a short poem about the sea.", "Name a car.")
    ]
    greedy = SamplingParams(max_tokens=20, temperature=0)
    solo = [engine.generate([p], greedy)[0].token_ids for p in prompts[1:]]
    rids = [engine.add_request(p, greedy) for p in prompts]
    got = {r: [] for r in rids}
    for step in range(30):
        if step == 4:
            assert engine._inflight is not None
            engine.abort(rids[0])  # the first row of the in-flight step
        for o in engine.step():
            got[o.request_id].append(o)
        if not engine.has_unfinished:
            break
    assert [got[r][-1].token_ids for r in rids[1:]] == solo
    assert all(not o.finished for o in got[rids[0]])
    assert engine.block_manager.usage == 0.0


def test_stop_token_text_is_not_in_the_output(engine):
    """As in vLLM: the id that stopped the request stays in token_ids, its text does not enter the text."""
    prompt = chat(engine, "Write a short poem about the sea.")
    full = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0]
    tok = full.token_ids[6]
    o = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[tok]))[0]
    cut = full.token_ids.index(tok)
    assert o.token_ids == full.token_ids[: cut + 1] and o.stop_reason == tok
    assert o.text == engine.tokenizer.decode(full.token_ids[:cut], skip_special_tokens=True)
    assert engine.tokenizer.decode([tok]).strip()  # the stop token has visible text, and it was left out
    assert len(o.text) < len(engine.tokenizer.decode(full.token_ids[: cut + 1], skip_special_tokens=True))
