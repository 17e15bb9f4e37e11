"""RayExecutor on the 2-core CPU machine: TP=2 (gloo, one TPWorker per CPU slot) against TP=1 in-process."""

from __future__ import annotations

import time

import pytest

from configs import EngineConfig, SamplingParams
from tests.conftest import DEFAULT_MODEL, real_prompts

MAX_TOKENS = 16


def _config(tp: int) -> EngineConfig:
    return EngineConfig(
        model=DEFAULT_MODEL,
        device="cpu",
        max_model_len=1024,
        max_num_seqs=8,
        max_num_batched_tokens=1024,
        tensor_parallel_size=tp,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
    )


@pytest.fixture(scope="module")
def tp2_engine(ray_session):
    from actors import RayExecutor
    from flexspec.engine.llm_engine import LLMEngine

    cfg = _config(2)
    engine = LLMEngine(cfg, executor=RayExecutor(cfg, execute_timeout_s=120))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def prompts(engine):
    return real_prompts(engine, n_each=1)  # GSM8K + MT-Bench (chat template) and HumanEval (raw code)


def test_placement_group_is_strict_pack_one_bundle_per_rank(tp2_engine, ray_session):
    ex = tp2_engine.executor
    table = ray_session.util.placement_group_table(ex.placement_group)
    assert table["strategy"] == "STRICT_PACK"
    assert [b for b in table["bundles"].values()] == [{"CPU": 1.0}, {"CPU": 1.0}]
    pids = ray_session.get([w.pid.remote() for w in ex.workers])
    assert len(set(pids)) == 2  # one process per rank


def test_tp2_matches_tp1_greedy_with_speculation(tp2_engine, engine, prompts):
    """Same T=0 tokens from TP=2 with ngram speculation as from the plain TP=1 in-process engine, and the
    TP=2 engine really speculated: its policy chose decoupled steps and drafts were verified."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    want = engine.generate(prompts, params)
    got = tp2_engine.generate(prompts, params)
    for w, g in zip(want, got):
        assert len(g.token_ids) == MAX_TOKENS
        assert g.token_ids == w.token_ids, (w.text, g.text)
        assert g.text == w.text
    assert tp2_engine.policy.mode_counts.get("decoupled", 0) > 0
    assert tp2_engine.spec_metrics.num_drafts > 0, tp2_engine.spec_metrics.as_dict()
    # Accepted drafts too (their K/V written on both ranks): the policy's warm-up always has decoupled steps.
    assert tp2_engine.spec_metrics.num_accepted_tokens > 0, tp2_engine.spec_metrics.as_dict()
    # The worker group holds the same number of KV blocks on both ranks and released them all.
    assert tp2_engine.block_manager.usage == 0.0


def test_collective_rpc_reaches_every_rank(tp2_engine):
    dims = tp2_engine.executor.collective_rpc("kv_bytes_per_block")
    assert len(dims) == 2 and all(d > 0 for d in dims)


def test_watchdog_times_out_a_hung_rank(tp2_engine, ray_session):
    from actors import WorkerGroupError
    from actors.ray_executor import RayExecutor

    @ray_session.remote(num_cpus=0)
    def hang() -> None:
        time.sleep(30)

    ex = RayExecutor.__new__(RayExecutor)  # only the watchdog, on a fresh (unbroken) instance
    ex._broken = None
    t0 = time.perf_counter()
    with pytest.raises(WorkerGroupError, match="did not answer"):
        ex._gather([hang.remote()], 0.5, "execute")
    assert time.perf_counter() - t0 < 5
    with pytest.raises(WorkerGroupError, match="broken"):  # and stays broken
        ex._gather([], 1, "execute")


def test_dead_rank_raises_instead_of_hanging(tp2_engine, ray_session):
    """Kill rank 1: the next step fails fast with WorkerGroupError (rank 0 would wait in all_reduce)."""
    from actors import WorkerGroupError

    ex = tp2_engine.executor
    ray_session.kill(ex.workers[1], no_restart=True)
    tp2_engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=4, temperature=0.0))
    t0 = time.perf_counter()
    with pytest.raises(WorkerGroupError):
        tp2_engine.step()
    assert time.perf_counter() - t0 < 30


def test_too_many_ranks_fail_fast(ray_session):
    """TP=4 on a 2-CPU cluster: a clear error at once, not a placement group that never schedules."""
    from actors import RayExecutor, WorkerGroupError

    with pytest.raises(WorkerGroupError, match="needs 4 CPU"):
        RayExecutor(_config(4))
