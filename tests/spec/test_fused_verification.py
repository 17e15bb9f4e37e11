"""The captured tail of a device-side verification step (``FusedVerifyGraphs``): acceptance test, DFlash context
and next block read the decode graph's padded outputs in place. On CPU the same decode-graph layout and tail run
uncaptured (``capture=False``); they must emit the eager device-side path's tokens and drafts step for step, and
plain decoding's outputs, also with dummy sequences padding the batch and with context left by plain steps
(issue 6: the batch-1 speculative step's ~55 eager launches)."""

from __future__ import annotations

import pytest

from configs import SamplingParams
from flexspec.engine.cuda_graphs import DecodeGraphs
from flexspec.engine.model_runner import verification_query_lens
from flexspec.spec.metrics import SpecDecodingMetrics
from flexspec.spec.policy import Decision
from tests.spec.conftest import RAW_PROMPTS, on_worker_outputs, spec_engine

pytestmark = pytest.mark.slow

DFLASH = {"method": "dflash", "model": "smollm2-135m-instruct-dflash", "num_speculative_tokens": 7}


@pytest.fixture(scope="module")
def fused_eng():
    """A decoupled DFlash engine whose runner replays uncaptured decode graphs (batch sizes 1, 2, 4, 8; query
    lengths 1 with and without the drafter's layers, 2, 4, 8) and whose worker has their uncaptured tails."""
    eng = spec_engine({**DFLASH, "execution": "decoupled"}, max_num_seqs=8)
    runner = eng.executor.runner
    worker = runner.spec_worker
    layers = tuple(worker.drafter.capture_layers)
    sizes = [1, 2, 4, 8]
    runner.graphs = [DecodeGraphs(runner, sizes, capture=False)] + [
        DecodeGraphs(runner, sizes, query_len=q, capture_layers=layers, capture=False)
        for q in [1, *verification_query_lens(7)]
    ]
    runner.graphs.sort(key=lambda g: g.q)
    worker.capture_fused(runner.graphs, capture=False)
    assert sorted(worker.fused) == [(1, False), (2, False), (4, False), (8, False)]
    return eng


def _run(eng, prompts, params, fused: bool, decide=None):
    """Generate; returns outputs, every step's (emitted, next drafts), spec metrics, fused steps run."""
    worker = eng.executor.runner.spec_worker
    tails, used = worker.fused, []
    launch = worker._launch_fused
    worker._launch_fused = lambda inp, *a: used.append(inp) or launch(inp, *a)
    if not fused:
        worker.fused = {}
    steps: list = []
    policy_decide = eng.policy.decide
    if decide is not None:
        eng.policy.decide = decide
    try:
        with on_worker_outputs(worker, lambda inp, out: steps.append((out.token_ids, out.draft_token_ids))):
            eng.spec_metrics = SpecDecodingMetrics()
            outs = [o.token_ids for o in eng.generate(prompts, params)]
        return outs, steps, eng.spec_metrics.as_dict(), len(used)
    finally:
        worker.fused = tails
        del worker._launch_fused
        eng.policy.decide = policy_decide


@pytest.mark.parametrize("batch", [1, 5])
def test_fused_tail_equals_the_eager_device_side_step(plain_128, fused_eng, batch):
    """Batch 5 replays the graphs of batch size 8: three dummy sequences write and draft nothing."""
    prompts, want = plain_128
    prompts, want = prompts[:batch], [w[:40] for w in want[:batch]]
    params = SamplingParams(max_tokens=40, temperature=0)
    f_out, f_steps, f_metrics, n_fused = _run(fused_eng, prompts, params, True)
    e_out, e_steps, e_metrics, n_eager = _run(fused_eng, prompts, params, False)
    assert f_out == e_out == want
    assert f_steps == e_steps  # every step's emitted tokens and next drafts
    assert f_metrics == e_metrics and f_metrics["num_accepted_tokens"] > 0
    assert n_fused > 0 and n_eager == 0


def test_fused_tail_after_plain_steps_writes_their_deferred_context(plain_128, fused_eng):
    """Two plain steps, then a drafting one: the drafting step first writes the context the plain steps left
    (from the feature cache), then replays the tail; drafts equal the eager path's."""
    prompts, want = plain_128
    prompts, want = prompts[:3], [w[:40] for w in want[:3]]
    params = SamplingParams(max_tokens=40, temperature=0)

    def decider():
        n = [0]

        def decide(sched):
            n[0] += 1
            return Decision("decoupled", 7) if n[0] % 3 == 0 else Decision("plain", 0)

        return decide

    assert fused_eng.executor.runner.spec_worker.drafter.defer_context
    f_out, f_steps, f_metrics, n_fused = _run(fused_eng, prompts, params, True, decider())
    e_out, e_steps, e_metrics, _ = _run(fused_eng, prompts, params, False, decider())
    assert f_out == e_out == want
    assert f_steps == e_steps and f_metrics == e_metrics
    assert n_fused > 0 and f_metrics["num_accepted_tokens"] > 0


def test_the_step_switching_to_plain_replays_the_tail_and_keeps_no_drafts(plain_128, fused_eng):
    """decoupled, plain, plain, ...: each plain decision after a drafting step verifies its drafts and proposes
    none; it runs fused like the drafting steps, emits what the eager path emits and returns no drafts."""
    prompts, want = plain_128
    prompts, want = prompts[:2], [w[:30] for w in want[:2]]
    params = SamplingParams(max_tokens=30, temperature=0)
    worker = fused_eng.executor.runner.spec_worker
    switches: list = []
    launch = worker._launch_fused
    n = [0]

    def decide(sched):
        n[0] += 1
        return Decision("decoupled", 7) if n[0] % 3 == 0 else Decision("plain", 0)

    def spy(inp, *a):
        if inp.num_speculative_tokens == 0:
            switches.append(inp)
        return launch(inp, *a)

    worker._launch_fused = spy  # _run wraps it and removes the instance attribute when done
    try:
        f_out, f_steps, f_metrics, _ = _run(fused_eng, prompts, params, True, decide)
    finally:
        worker.__dict__.pop("_launch_fused", None)
    n[0] = 0
    e_out, e_steps, e_metrics, _ = _run(fused_eng, prompts, params, False, decide)
    assert f_out == e_out == want and f_steps == e_steps and f_metrics == e_metrics
    assert switches and all(any(inp.num_draft_tokens) for inp in switches)


def test_sampled_and_logprob_steps_stay_on_the_eager_path(fused_eng):
    worker = fused_eng.executor.runner.spec_worker
    prompt = fused_eng.apply_chat_template([{"role": "user", "content": "Count from 1 to 20."}])
    for params in (
        SamplingParams(max_tokens=16, temperature=0.8, seed=3),
        SamplingParams(max_tokens=16, temperature=0, logprobs=1),
    ):
        _, steps, _, n_fused = _run(fused_eng, [prompt], params, True)
        assert n_fused == 0 and len(steps) > 1, params
    assert worker.fused


@pytest.mark.gpu
def test_captured_fused_tail_on_gpu_matches_the_eager_device_side_step():
    """On the GPU (fp32) the tails are captured: a batch of 5 (graphs of batch size 8) and a batch of 1 emit
    the eager device-side path's tokens; drafts may differ where a differently batched projection rounds a
    near-tie otherwise, so accepted counts agree within 2%."""
    prompts = RAW_PROMPTS
    eng = spec_engine(
        {**DFLASH, "execution": "decoupled"}, device="cuda", dtype="float32", max_num_seqs=8,
        speculation_profile_steps=0,
    )  # fmt: skip
    assert eng.executor.runner.spec_worker.fused, "no fused tail was captured"
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)  # raw prompts may end at once
    for batch in (prompts, prompts[:1]):
        f_out, _, f_metrics, n_fused = _run(eng, batch, params, True)
        e_out, _, e_metrics, n_eager = _run(eng, batch, params, False)
        assert f_out == e_out and n_fused > 0 and n_eager == 0
        a_f, a_e = f_metrics["num_accepted_tokens"], e_metrics["num_accepted_tokens"]
        assert a_e > 0 and abs(a_f - a_e) <= max(2, a_e // 50), (a_f, a_e)
