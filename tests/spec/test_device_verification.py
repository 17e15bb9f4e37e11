"""Device-side verification steps (``SpecDecodeWorker.launch`` / ``collect``): the acceptance test on the device
equals the host rule, and an engine verifying + drafting without a host sync in between emits the same tokens
and the same drafts as one that verifies on the host first (issue 6: the batch-1 speculative step)."""

from __future__ import annotations

import itertools

import pytest
import torch

from configs import SamplingParams
from flexspec.engine.sampler import SamplingMetadata
from flexspec.spec.metrics import SpecDecodingMetrics
from flexspec.spec.verifier import _verify_by_target_sample, accept_deterministic_drafts
from tests.spec.conftest import on_worker_outputs, spec_engine

pytestmark = pytest.mark.slow  # among the longest modules: scheduled first

SPECS = {
    "dflash": {"method": "dflash", "model": "smollm2-135m-instruct-dflash"},
    "flexdraft": {"method": "flexdraft", "model": "smollm2-135m-instruct-flexdraft"},
}


@pytest.mark.parametrize("seed", range(5))
def test_device_acceptance_equals_the_host_rule(seed):
    g = torch.Generator().manual_seed(seed)
    S, K, V = 7, 5, 4  # a tiny vocabulary so that drafts often match
    num_drafts = torch.randint(0, K + 1, (S,), generator=g)
    N = int((num_drafts + 1).sum())
    logits = torch.randn(N, V, generator=g)
    target = logits.argmax(-1)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), (num_drafts + 1).cumsum(0)[:-1]])
    drafts = torch.randint(0, V, (S, K), generator=g)
    for s in range(S):  # plant runs of correct drafts of every length
        a = int(torch.randint(0, int(num_drafts[s]) + 1, (1,), generator=g))
        drafts[s, :a] = target[starts[s] : starts[s] + a]
    tokens, accepted = accept_deterministic_drafts(target, starts, num_drafts, drafts)
    meta = SamplingMetadata([(0.0, 1.0, -1, 0, 0)] * N, torch.device("cpu"))
    host = _verify_by_target_sample(
        logits, meta, num_drafts.tolist(), [drafts[s, : int(num_drafts[s])].tolist() for s in range(S)]
    )
    assert [tokens[s, : int(accepted[s]) + 1].tolist() for s in range(S)] == host
    assert all(len(h) == int(a) + 1 for h, a in zip(host, accepted))


def _run(eng, prompts, params, device_verification: bool, launched: list | None = None):
    """Generate; returns outputs, every step's (emitted, next drafts), spec metrics and the number of
    device-side steps, whose inputs go to ``launched``."""
    worker = eng.executor.runner.spec_worker
    worker.device_verification = device_verification
    steps: list[tuple[list[list[int]], list[list[int]]]] = []
    on_device = worker._launch_on_device
    used = [] if launched is None else launched
    worker._launch_on_device = lambda inp, *a: used.append(inp) or on_device(inp, *a)
    try:
        with on_worker_outputs(worker, lambda inp, out: steps.append((out.token_ids, out.draft_token_ids))):
            eng.spec_metrics = SpecDecodingMetrics()
            outs = [o.token_ids for o in eng.generate(prompts, params)]
        return outs, steps, eng.spec_metrics.as_dict(), len(used)
    finally:
        del worker._launch_on_device
        worker.device_verification = True


@pytest.fixture(scope="module", params=sorted(SPECS))
def spec_eng(request):
    """A decoupled engine with a shipped drafter (DFlash, then FlexDraft): real acceptance, so accepted runs
    of many lengths occur."""
    spec = {**SPECS[request.param], "execution": "decoupled", "num_speculative_tokens": 7}
    return spec_engine(spec, max_num_seqs=8)


@pytest.mark.parametrize("batch", [1, 8])
def test_device_side_steps_equal_host_verification_and_plain_decoding(plain_128, spec_eng, batch):
    prompts, want = plain_128
    prompts, want = prompts[:batch], [w[:40] for w in want[:batch]]
    params = SamplingParams(max_tokens=40, temperature=0)
    dev_out, dev_steps, dev_metrics, n_device = _run(spec_eng, prompts, params, True)
    host_out, host_steps, host_metrics, n_host = _run(spec_eng, prompts, params, False)
    assert dev_out == host_out == want
    assert dev_steps == host_steps  # every step's emitted tokens and next drafts
    assert dev_metrics == host_metrics and dev_metrics["num_accepted_tokens"] > 0
    assert n_device > 0 and n_host == 0


def test_device_side_steps_equal_host_verification_when_sampling(plain_128, spec_eng):
    """T > 0: both paths sample the target with the plain sampler's seeded noise, so they agree token for
    token (and a seeded request is reproducible)."""
    prompts = plain_128[0][:4]
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=11)
    dev_out, dev_steps, _, n_device = _run(spec_eng, prompts, params, True)
    host_out, host_steps, _, _ = _run(spec_eng, prompts, params, False)
    assert dev_out == host_out and dev_steps == host_steps and n_device > 0


def test_logprobs_on_device_side_steps(spec_eng):
    eng = spec_eng
    prompt = eng.apply_chat_template([{"role": "user", "content": "Count from 1 to 20."}])
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=2)
    got = {}
    for flag in (True, False):
        eng.executor.runner.spec_worker.device_verification = flag
        eng.add_request(prompt, params, request_id=f"lp-{flag}")
        tokens, logprobs = [], []
        while eng.has_unfinished:
            for o in eng.step():
                tokens += o.new_token_ids
                logprobs += [round(lp.logprob, 4) for lp in o.new_logprobs]
        got[flag] = (tokens, logprobs)
    eng.executor.runner.spec_worker.device_verification = True
    assert got[True] == got[False] and len(got[True][1]) == len(got[True][0]) == 24


def test_device_and_host_verified_steps_alternate(plain_128, spec_eng):
    """A device-side step leaves the worker's histories stale (the engine's token lists hold the committed
    tokens) and a host-verified step that follows reads them from there: steps taking the two paths in turn
    emit the all-host run's tokens and drafts, and plain decoding's outputs."""
    prompts, want = plain_128
    prompts, want = prompts[:4], [w[:40] for w in want[:4]]
    params = SamplingParams(max_tokens=40, temperature=0)
    worker = spec_eng.executor.runner.spec_worker
    runs_on_device = worker._runs_on_device
    steps = itertools.count()
    host_steps_of: dict[int, bool] = {}  # id(inp) -> verified on the host (asked more than once per step)

    def every_third_on_the_host(inp):
        host = host_steps_of.setdefault(id(inp), next(steps) % 3 == 2)
        return runs_on_device(inp) and not host

    worker._runs_on_device = every_third_on_the_host
    try:
        mixed_out, mixed_steps, mixed_metrics, n_device = _run(spec_eng, prompts, params, True)
    finally:
        del worker._runs_on_device
    host_out, host_steps, host_metrics, _ = _run(spec_eng, prompts, params, False)
    assert 0 < n_device < len(mixed_steps) - 5  # both paths, many times
    assert mixed_out == host_out == want and mixed_steps == host_steps and mixed_metrics == host_metrics


@pytest.mark.parametrize("method", sorted(SPECS))
def test_steps_that_prefill_verify_on_the_device(plain_128, method):
    """Chunked prefill in a speculative batch: prompts arrive while others decode (2 running, outputs of
    different lengths) and prompts longer than 24 tokens prefill in chunks, so steps mix verified decode
    queries with prompt chunks that end their prompt (emit their first token, then get drafts) and chunks that
    do not (emit nothing). DFlash and FlexDraft (decoupled) verify and draft those steps on the device as well;
    they emit the same tokens and drafts as host verification, and the outputs are plain decoding's."""
    spec = {**SPECS[method], "execution": "decoupled", "num_speculative_tokens": 7}
    eng = spec_engine(spec, max_num_seqs=2, max_num_batched_tokens=24)
    prompts, want = plain_128
    lengths = [40, 9, 27, 16, 33]
    prompts, want = prompts[: len(lengths)], [w[:n] for w, n in zip(want, lengths)]
    params = [SamplingParams(max_tokens=n, temperature=0) for n in lengths]
    launched: list = []
    dev_out, dev_steps, dev_metrics, n_device = _run(eng, prompts, params, True, launched)
    host_out, host_steps, host_metrics, n_host = _run(eng, prompts, params, False)
    kinds = set()
    for inp in launched:
        if any(d and q == d + 1 for q, d in zip(inp.query_lens, inp.num_draft_tokens)):  # drafts verified
            chunks = [s for s, (q, d) in enumerate(zip(inp.query_lens, inp.num_draft_tokens)) if q != d + 1]
            kinds.update("ends its prompt" if inp.samples[s] else "emits nothing" for s in chunks)
    assert kinds == {"ends its prompt", "emits nothing"}  # prompt chunks next to verified drafts
    assert dev_out == host_out == want
    assert dev_steps == host_steps
    assert dev_metrics == host_metrics and dev_metrics["num_accepted_tokens"] > 0
    assert n_device > 0 and n_host == 0


def test_preempted_prompts_start_their_drafter_state_over_on_the_device(engine):
    """KV-cache pressure (14 blocks of 16 tokens for 4 sequences of ~80 tokens) preempts requests; a preempted
    request is prefilled again from position 0 inside a speculative batch. The device-side step forgets its
    drafter state before writing the new context, as the host path does before drafting: same tokens and
    drafts as host verification, and plain decoding's outputs."""
    texts = ("Tell me about dragons.", "Name a car.", "Write a haiku.", "Say hi.")
    prompts = [engine.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    params = SamplingParams(max_tokens=40, temperature=0)
    want = [o.token_ids for o in engine.generate(prompts, params)]
    spec = {**SPECS["dflash"], "execution": "decoupled", "num_speculative_tokens": 7}
    eng = spec_engine(spec, max_model_len=192, max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=14)
    launched: list = []
    dev_out, dev_steps, _, _ = _run(eng, prompts, params, True, launched)
    preemptions = eng.stats.num_preemptions
    host_out, host_steps, _, _ = _run(eng, prompts, params, False)
    seen: set[int] = set()
    recomputed = 0
    for inp in launched:
        recomputed += sum(c == 0 and sid in seen for sid, c in zip(inp.seq_ids, inp.context_lens))
        seen.update(inp.seq_ids)
    assert preemptions > 0 and recomputed > 0
    assert dev_out == host_out == want and dev_steps == host_steps


@pytest.mark.parametrize("evictable", [True, False], ids=["evicts-an-idle-sequence", "nothing-to-evict"])
def test_drafter_cache_short_of_blocks(plain_128, evictable):
    """DFlash's own KV cache runs short of blocks (all but 6 taken before the run). Held by a sequence outside
    the batch, they are taken back from it (evicted) and the device-side steps emit the host path's tokens and
    drafts. With nothing to evict, sequences that get no blocks write no drafter context and keep no drafts;
    the device-side step reserves blocks for the whole query (its accepted length is known on the device only)
    where the host path reserves the committed positions, so the two may draft differently under that pressure,
    but both emit plain decoding's outputs."""
    spec = {**SPECS["dflash"], "execution": "decoupled", "num_speculative_tokens": 7}
    eng = spec_engine(spec, max_num_seqs=4)
    cache = eng.executor.runner.spec_worker.drafter.cache
    prompts, want = plain_128
    prompts, want = prompts[:4], [w[:40] for w in want[:4]]
    params = SamplingParams(max_tokens=40, temperature=0)
    refused: list[int] = []
    reserve = cache.reserve

    def counted(seq_id, num_tokens, evictable=None):
        ok = reserve(seq_id, num_tokens, evictable)
        refused.extend([] if ok else [seq_id])
        return ok

    def run(device: bool):
        hog = [cache.free_blocks.popleft() for _ in range(len(cache.free_blocks) - 6)]
        if evictable:
            cache.tables[-1] = hog  # a sequence that is not in any step
        try:
            return _run(eng, prompts, params, device), -1 not in cache.tables
        finally:
            left = cache.tables.pop(-1, None) if evictable else hog
            cache.free_blocks.extend(left or [])

    cache.reserve = counted
    try:
        (dev_out, dev_steps, dev_metrics, n_device), dev_evicted = run(True)
        dev_refused, refused[:] = list(refused), []
        (host_out, host_steps, host_metrics, _), host_evicted = run(False)
    finally:
        del cache.reserve
    assert dev_out == host_out == want and n_device > 0
    if evictable:
        assert dev_evicted and host_evicted and not dev_refused
        assert dev_steps == host_steps and dev_metrics == host_metrics
        assert dev_metrics["num_accepted_tokens"] > 0
    else:
        assert dev_refused and refused  # both paths ran short
