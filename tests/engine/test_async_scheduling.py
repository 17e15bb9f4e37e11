"""Async scheduling: the next plain decode step is scheduled and launched before the previous step's sampled
tokens are read back; its input ids are gathered on the device (issue 2: the device must not wait for the host).

On a CPU the steps run synchronously, so these tests check what users see: the same tokens, text, streamed
deltas, logprobs and finish reasons as without it, requests joining, aborted and preempted mid-stream, and no
token computed for a request that ends on its length. The device-side gather itself is the same code on CUDA.
"""

from __future__ import annotations

import contextlib

import pytest

from configs import EngineConfig, SamplingParams
from flexspec.engine.llm_engine import LLMEngine
from flexspec.engine.model_input import PLACEHOLDER_TOKEN_ID, ModelInput
from tests.conftest import DEFAULT_MODEL
from tests.engine.test_async_output import chat, run_streaming


@contextlib.contextmanager
def async_scheduling(engine, on: bool):
    assert not engine.has_unfinished
    engine.config.async_scheduling = on
    try:
        yield
    finally:
        engine.config.async_scheduling = None


@contextlib.contextmanager
def count_launches(engine):
    """Record, per launched step, (number of input tokens, whether its ids came from the previous step)."""
    launched: list[tuple[int, bool]] = []
    orig = engine.executor.launch

    def launch(inp: ModelInput):
        launched.append((inp.num_tokens, inp.prev_token_rows is not None))
        return orig(inp)

    engine.executor.launch = launch
    try:
        yield launched
    finally:
        del engine.executor.launch


def test_default_is_off_on_cpu_and_needs_overlapped_output(engine):
    assert engine.config.async_scheduling is None and not engine.schedules_ahead  # CPU: nothing to gain
    with async_scheduling(engine, True):
        assert engine.schedules_ahead
        engine.config.async_output_processing = False
        try:
            assert not engine.schedules_ahead
        finally:
            engine.config.async_output_processing = True


def test_async_scheduling_matches_synchronous_steps(engine):
    prompts = [
        chat(engine, "Write a short poem about the sea."),
        chat(engine, "What is 12 times 7? Answer briefly."),
        chat(engine, "List three colours."),
        chat(engine, "Say hello."),
        chat(engine, "Tell me about dragons."),
    ]
    params = [
        SamplingParams(max_tokens=40, temperature=0, stop=["wave", "\n\n"]),
        SamplingParams(max_tokens=24, temperature=0, logprobs=2),
        SamplingParams(max_tokens=9, temperature=0.8, seed=7),
        SamplingParams(max_tokens=40, temperature=0),  # ends on EOS (token 30) before max_tokens
        SamplingParams(max_tokens=33, temperature=0.7, top_p=0.9, seed=3),
    ]
    with async_scheduling(engine, True), count_launches(engine) as launched:
        ahead = run_streaming(engine, prompts, params)
    with async_scheduling(engine, False):
        synchronous = run_streaming(engine, prompts, params)
    for (text_a, ids_a, lps_a, out_a), (text_b, ids_b, lps_b, out_b) in zip(ahead, synchronous):
        assert out_a.token_ids == out_b.token_ids and ids_a == out_a.token_ids == ids_b
        assert text_a == out_a.text == out_b.text == text_b
        assert (out_a.finish_reason, out_a.stop_reason) == (out_b.finish_reason, out_b.stop_reason)
        assert lps_a == lps_b
    assert all(t >= 0 for o in ahead for t in o[3].token_ids)  # no placeholder leaked
    assert ahead[3][3].finish_reason == "stop" and len(ahead[3][3].token_ids) < 40
    # Steps were really launched from the previous step's ids (the 24-token request with logprobs makes the
    # step after each of its steps wait for the readback, so not every decode step is launched ahead).
    assert sum(early for _, early in launched) >= 8
    assert engine.block_manager.usage == 0.0


def test_requests_joining_and_aborted_mid_stream(engine):
    texts = ["Name a fruit.", "Write a short poem about the sea.", "Name a car.", "Count to ten."]
    greedy = SamplingParams(max_tokens=20, temperature=0)
    alone = {t: engine.generate([chat(engine, t)], greedy)[0].token_ids for t in texts}
    with async_scheduling(engine, True), count_launches(engine) as launched:
        rids = {engine.add_request(chat(engine, t), greedy): t for t in texts[:2]}
        got: dict[str, list] = {r: [] for r in rids}
        for step in range(200):
            if step == 3:  # a prompt joins a running batch: a step that prefills, launched ahead
                rids[engine.add_request(chat(engine, texts[2]), greedy)] = texts[2]
            if step == 6:
                drop = engine.add_request(
                    chat(engine, texts[3]), SamplingParams(max_tokens=50, temperature=0)
                )
                rids[drop] = texts[3]
            if step == 9:
                assert engine._inflight is not None
                engine.abort(drop)  # its row of the step in flight (launched ahead) is dropped
            for o in engine.step():
                got.setdefault(o.request_id, []).append(o)
            if not engine.has_unfinished:
                break
    for r, t in rids.items():
        if r == drop:
            assert all(not o.finished for o in got[r])
        else:
            assert got[r][-1].finished and got[r][-1].token_ids == alone[t]
    assert any(early for _, early in launched)
    assert engine.block_manager.usage == 0.0


def test_steps_in_which_prompts_join_are_launched_ahead_too(engine):
    """Requests join as others finish (3 running at most): the step that prefills a new prompt next to the
    running decodes is launched before the last step's readback, its decode rows' ids gathered on the device
    and its prompt rows' ids from the host; the tokens are the synchronous steps'."""
    prompts = [
        chat(engine, t) for t in ("Name a fruit.", "Say hi.", "Name a car.", "Count to five.", "Say yes.")
    ]
    params = [SamplingParams(max_tokens=n, temperature=0) for n in (6, 9, 12, 7, 10)]
    ref = [o.token_ids for o in engine.generate(prompts, params)]
    eng = LLMEngine(EngineConfig(max_model_len=512, max_num_seqs=3, device="cpu", async_scheduling=True))
    rows_seen: list[list[int]] = []  # prev_token_rows of each step launched from the previous step's ids
    orig = eng.executor.launch

    def launch(inp: ModelInput):
        if inp.prev_token_rows is not None:
            rows_seen.append(list(inp.prev_token_rows))
        return orig(inp)

    eng.executor.launch = launch
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == ref
    joined = [r for r in rows_seen if -1 in r and any(x >= 0 for x in r)]  # prompt rows next to decode rows
    assert len(joined) >= 2, rows_seen
    assert eng.block_manager.usage == 0.0


def test_one_token_prompts_joining_replay_the_decode_graph(engine):
    """A request with a 1-token prompt joins running decodes: every query is 1 token, so the step launched ahead
    fits the decode graph (q = 1), its decode rows' ids gathered on the device and the prompt's id kept as
    staged (row -1). Uncaptured decode graphs on the CPU run the same staging and gather as captured ones."""
    from flexspec.engine.cuda_graphs import DecodeGraphs

    prompts: list[str | list[int]] = [
        chat(engine, "Name a fruit."),
        [engine.tokenizer.encode("Hello")[0]],
        chat(engine, "Say hi."),
        [504],
    ]
    params = [SamplingParams(max_tokens=n, temperature=0) for n in (5, 8, 9, 6)]
    ref = [o.token_ids for o in engine.generate(prompts, params)]
    eng = LLMEngine(EngineConfig(max_model_len=512, max_num_seqs=2, device="cpu", async_scheduling=True))
    runner = eng.executor.runner
    runner.graphs = [DecodeGraphs(runner, [1, 2], capture=False)]
    replayed: list[list[int]] = []  # prev_token_rows of the decode-graph replays with ids gathered
    replay = runner.graphs[0].replay

    def counted(inp, prev_tokens=None):
        if inp.prev_token_rows is not None:
            replayed.append(list(inp.prev_token_rows))
        return replay(inp, prev_tokens)

    runner.graphs[0].replay = counted
    assert [o.token_ids for o in eng.generate(prompts, params)] == ref
    assert any(-1 in r and any(x >= 0 for x in r) for r in replayed), replayed
    assert eng.block_manager.usage == 0.0


def test_a_request_ending_on_its_length_computes_no_extra_token(engine):
    prompt = chat(engine, "Count from one to twenty in words.")
    full = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]
    with async_scheduling(engine, True), count_launches(engine) as launched:
        o = engine.generate([prompt], SamplingParams(max_tokens=5, temperature=0))[0]
    assert o.token_ids == full.token_ids[:5]
    assert len(launched) == 5  # the prefill + 4 decode steps: nothing launched after the 5th token
    # decode ids come from the previous step's, the prefill's included
    assert [early for _, early in launched] == [False, True, True, True, True]
    word = engine.tokenizer.decode(full.token_ids[5:8]).strip().split()[0]
    with async_scheduling(engine, True), count_launches(engine) as launched:
        o = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop=[word]))[0]
    assert o.finish_reason == "stop" and o.stop_reason == word
    # A stop string is only seen once the text is decoded: one step past it is launched and its token dropped.
    assert len(launched) == len(o.token_ids) + 1


def test_preemption_and_chunked_prefill_with_async_scheduling(engine):
    prompts = [
        chat(engine, t) for t in ("Tell me about dragons.", "Name a car.", "Write a haiku.", "Say hi.")
    ]
    params = SamplingParams(max_tokens=40, temperature=0)
    ref = [o.token_ids for o in engine.generate(prompts, params)]
    # 16-token steps force chunked prefill; 14 KV blocks of 16 tokens cannot hold 4 sequences of ~80 tokens
    # (prompt + 40) -> preemption.
    small = LLMEngine(
        EngineConfig(
            max_model_len=192,
            max_num_batched_tokens=16,
            max_num_seqs=4,
            num_kv_blocks=14,
            device="cpu",
            async_scheduling=True,
        )
    )
    with count_launches(small) as launched:
        outs = small.generate(prompts, params)
    assert small.stats.num_preemptions > 0 and any(early for _, early in launched)
    assert [o.token_ids for o in outs] == ref
    assert small.block_manager.usage == 0.0


def test_forward_refuses_prev_token_rows_without_the_previous_tokens(engine):
    runner = engine.executor.runner
    inp = ModelInput([0], [0], [-1], [[0]], [0], [1], [0], prev_token_rows=[0])
    with pytest.raises(ValueError, match="prev_token_rows"):
        runner.forward(inp)


@pytest.mark.gpu
def test_async_scheduling_on_gpu_matches_synchronous_steps():
    """On a GPU (CUDA graphs): on by default, decode steps are launched ahead (ids gathered on the device inside
    the decode-graph inputs) and the tokens equal the same engine's without it.

    fp32: a step launched ahead still holds the sequences that the previous step finished, so the two modes run
    some steps at different batch sizes, and bf16 GEMMs are not batch-invariant. H200, session 22: in bf16 one of
    eight requests took another token at a near tie (output 52 of 87; ``bench/results/h200-2026-12-03-s22/ab/
    diag_async.py``); in fp32 all eight were equal."""
    eng = LLMEngine(
        EngineConfig(model=DEFAULT_MODEL, max_model_len=1024, device="cuda", max_num_seqs=8, dtype="float32")
    )
    assert eng.schedules_ahead and eng.executor.runner.graphs
    texts = ["Write a short poem about the sea.", "What is 12 times 7?", "List three colours.", "Say hello.",
             "Tell me about dragons.", "Name a car.", "Count to ten.", "Explain gravity briefly."]  # fmt: skip
    prompts = [chat(eng, t) for t in texts]
    params = [SamplingParams(max_tokens=24 + 9 * i, temperature=0, stop=["\n\n"] if i == 2 else None)
              for i in range(len(texts))]  # fmt: skip
    params[5] = SamplingParams(max_tokens=40, temperature=0.8, seed=11)
    with count_launches(eng) as launched:
        ahead = run_streaming(eng, prompts, params)
    eng.config.async_scheduling = False
    synchronous = run_streaming(eng, prompts, params)
    for a, b in zip(ahead, synchronous):
        assert a[1] == b[1] == a[3].token_ids == b[3].token_ids and a[0] == b[0]
        assert a[3].finish_reason == b[3].finish_reason
    assert sum(early for _, early in launched) > len(launched) // 2
    assert eng.block_manager.usage == 0.0


def test_outputs_read_late_hold_the_tokens_of_their_step(engine):
    """``RequestOutput.token_ids`` is sliced from the sequence's token list when first read (no O(length) copy
    per request per step): read only after the run, each step's output still holds exactly the tokens emitted
    up to that step, also while async scheduling appends and pops placeholders past them."""
    import pickle

    prompts = [chat(engine, "Write a short poem about the sea."), chat(engine, "List three colours.")]
    params = SamplingParams(max_tokens=30, temperature=0)
    with async_scheduling(engine, True), count_launches(engine) as launched:
        rids = [engine.add_request(p, params) for p in prompts]
        kept: dict[str, list] = {r: [] for r in rids}
        streamed: dict[str, list[int]] = {r: [] for r in rids}
        while engine.has_unfinished:
            for o in engine.step():
                streamed[o.request_id] = streamed[o.request_id] + o.new_token_ids
                kept[o.request_id].append((o, list(streamed[o.request_id])))
    assert sum(early for _, early in launched) >= 10  # placeholders were appended past earlier outputs
    for r in rids:
        assert len(kept[r]) >= 10 and kept[r][-1][0].finished
        for out, want in kept[r]:
            assert out.num_output_tokens == len(want)
            assert out.token_ids == want and PLACEHOLDER_TOKEN_ID not in out.token_ids
        first = kept[r][0][0]
        copy = pickle.loads(pickle.dumps(first))
        assert copy == first and copy.token_ids == kept[r][0][1]


def test_a_step_scheduled_ahead_never_preempts(engine):
    """Under KV-cache pressure a step scheduled ahead must not preempt: the request that ends on EOS with the step
    in flight still holds its blocks then, so preempting would evict a request that scheduling after the result
    keeps (a known limitation until session 18). Such a step is scheduled after the result instead. Here "Say
    hello." ends on EOS after 30 tokens, in the step before the other request needs a new block; 8 blocks of 16
    tokens hold both only once the first one's blocks are free: synchronous scheduling preempts nothing."""
    from flexspec.engine.block_manager import BlockManager

    prompts = [chat(engine, "Say hello."), chat(engine, "Tell me about dragons.")]
    params = [SamplingParams(max_tokens=60, temperature=0), SamplingParams(max_tokens=40, temperature=0)]
    saved = engine.block_manager
    runs = {}
    try:
        for ahead in (True, False):
            engine.block_manager = engine.scheduler.block_manager = BlockManager(8, saved.block_size)
            before = (engine.stats.num_preemptions, engine.stats.num_ahead_schedules_deferred)
            with async_scheduling(engine, ahead):
                outs = engine.generate(prompts, params)
            runs[ahead] = (
                [(o.token_ids, o.finish_reason) for o in outs],
                engine.stats.num_preemptions - before[0],
                engine.stats.num_ahead_schedules_deferred - before[1],
            )
    finally:
        engine.block_manager = engine.scheduler.block_manager = saved
    (outs_a, preempted_a, deferred_a), (outs_s, preempted_s, deferred_s) = runs[True], runs[False]
    assert outs_a[0][1] == "stop" and len(outs_a[0][0]) == 30  # the scenario: EOS after 30 tokens
    assert outs_a == outs_s
    assert preempted_a == preempted_s == 0
    assert deferred_a >= 1 and deferred_s == 0  # the pressured step was scheduled after the result
