"""Steps that prefill replay ``MixedGraphs`` (issue 2; issue 6: run eagerly, each such step cost ~20 ms of host
time on the H200). CUDA graphs run only on a GPU; here the same padded layout runs eagerly (``capture=False``):
it gives the eager forward's logits, engines whose every prefill step takes it emit plain greedy outputs, and
the capture-time self-check that guards the GPU path catches a wrong layout."""

from __future__ import annotations

import pytest
import torch

from configs import EngineConfig, SamplingParams
from flexspec.engine import cuda_graphs
from flexspec.engine.cuda_graphs import MixedGraphs, stage_mixed_inputs
from flexspec.engine.graph_inputs import StagedInputs
from flexspec.engine.llm_engine import LLMEngine
from flexspec.engine.model_runner import MIXED_GRAPH_MAX_ERROR
from tests.conftest import DEFAULT_MODEL, plain_outputs, real_prompts
from tests.engine.test_graph_inputs import MAX_BLOCKS, make_input
from tests.spec.conftest import spec_engine


def test_staged_mixed_layout():
    T, S = 64, 6
    sizes = {"input_ids": T, "positions": T, "slot_mapping": T, "context_lens": S, "query_start_loc": S + 1,
             "block_tables": S * MAX_BLOCKS, "logits_rows": T}  # fmt: skip
    stage = StagedInputs(sizes, torch.device("cpu"))
    for name in sizes:  # garbage from an earlier, larger step must not leak into this one
        stage.host(name)[:] = 99
    inp = make_input([1, 4, 23], "all")
    stage_mixed_inputs(stage, inp, T, S, MAX_BLOCKS)
    stage.send()
    dev = stage.on_device
    n = inp.num_tokens
    assert dev("input_ids").tolist() == inp.input_ids + [0] * (T - n)
    assert dev("positions").tolist() == inp.positions + [0] * (T - n)
    assert dev("slot_mapping").tolist() == inp.slot_mapping + [-1] * (T - n)
    assert dev("query_start_loc").tolist() == [0, 1, 5, 28, T, T, T]  # dummy sequence [28, 64), then empty
    assert dev("context_lens").tolist() == inp.context_lens + [0] * (S - 3)
    tables = dev("block_tables").view(S, MAX_BLOCKS)
    for s, row in enumerate(inp.block_tables):
        assert tables[s, : len(row)].tolist() == row
    assert dev("logits_rows")[:n].tolist() == inp.logits_indices


def _runner(engine):
    return engine.executor.runner


def test_padded_step_equals_eager_forward(engine):
    """The self-check's step (decode + verification query reading the cache, and a prompt) through the padded
    layout of a 64-token graph: the same logits as the unpadded eager forward (fp32)."""
    runner = _runner(engine)
    graphs = MixedGraphs(runner, [32, 64], capture_layers=(2, 17), capture=False)
    assert runner._check_mixed_graphs(graphs) < 1e-4


def test_self_check_catches_a_wrong_layout(engine, monkeypatch):
    runner = _runner(engine)
    graphs = MixedGraphs(runner, [64], capture=False)
    stage = cuda_graphs.stage_mixed_inputs

    def forgets_the_context(st, inp, *args):  # e.g. a layout bug that drops the cached context
        stage(st, inp, *args)
        st.host("context_lens")[:] = 0

    monkeypatch.setattr(cuda_graphs, "stage_mixed_inputs", forgets_the_context)
    assert runner._check_mixed_graphs(graphs) > MIXED_GRAPH_MAX_ERROR


@pytest.mark.parametrize(
    "limits",
    [{"max_num_seqs": 1}, {"max_num_seqs": 2}, {"max_num_batched_tokens": 16, "max_num_seqs": 8},
     {"max_model_len": 32}],
    ids=["one-seq", "two-seqs", "16-token-budget", "32-token-model-len"],
)  # fmt: skip
def test_self_check_fits_small_configurations(limits):
    """The start-up check builds its step within ``max_num_seqs``, the token budget and ``max_model_len``."""
    cfg = EngineConfig(model=DEFAULT_MODEL, device="cpu", **{"max_model_len": 1024, **limits})
    runner = LLMEngine(cfg).executor.runner
    graphs = MixedGraphs(runner, runner.mixed_graph_num_tokens(), capture=False)
    run = graphs.run
    seen = []
    graphs.run = lambda inp: seen.append(inp) or run(inp)
    assert runner._check_mixed_graphs(graphs) < 1e-4
    assert seen and len(seen[0].query_lens) == min(3, cfg.max_num_seqs)
    assert seen[0].num_tokens < graphs.size_for(seen[0].num_tokens)  # the dummy sequence is there too


def test_capture_sizes_always_hold_the_step_budget():
    cfg = EngineConfig(device="cpu", max_num_batched_tokens=300, cuda_graph_num_tokens=[64, 256, 512])
    from flexspec.engine.model_runner import ModelRunner

    runner = ModelRunner.__new__(ModelRunner)  # only the config is read
    runner.config = cfg
    assert runner.mixed_graph_num_tokens() == [64, 256, 300]
    runner.config = cfg.model_copy(update={"cuda_graph_num_tokens": []})
    assert runner.mixed_graph_num_tokens() == []


def _through_mixed_layout(eng: LLMEngine) -> dict[int | str, int]:
    """Send every step that no decode graph takes through the padded layout; returns token count -> steps (and
    "launched ahead" -> those whose decode rows' ids came from the previous step's, async scheduling)."""
    runner = _runner(eng)
    layers = tuple(runner.spec_worker.drafter.capture_layers) if runner.spec_worker is not None else ()
    graphs = MixedGraphs(runner, runner.mixed_graph_num_tokens(), capture_layers=layers, capture=False)
    used: dict[int | str, int] = {}
    run = graphs.run

    def counted(inp, prev_tokens=None):
        n = graphs.size_for(inp.num_tokens)
        used[n] = used.get(n, 0) + 1
        if inp.prev_token_rows is not None:
            used["launched ahead"] = used.get("launched ahead", 0) + 1
        return run(inp, prev_tokens)

    graphs.run = counted
    runner.mixed_graphs = graphs
    return used


@pytest.fixture(scope="module")
def turnover_case(engine, plain_128):
    """9 real prompts, 24 greedy tokens each, and the plain engine's outputs for them (cut from ``plain_128``)."""
    prompts = real_prompts(engine, n_each=3)
    params = SamplingParams(max_tokens=24, temperature=0)
    return prompts, params, plain_outputs(plain_128, prompts, 24)


def test_plain_engine_prefill_steps_through_mixed_layout(turnover_case):
    """4 sequences at a time with a 64-token step budget: prompts are chunked (and their chunks share steps
    with decodes); every one of those steps takes the padded layout and the outputs stay exact."""
    prompts, params, want = turnover_case
    eng = LLMEngine(EngineConfig(model=DEFAULT_MODEL, max_model_len=1024, device="cpu", max_num_seqs=4,
                                 max_num_batched_tokens=64, cuda_graph_num_tokens=[16, 32]))  # fmt: skip
    used = _through_mixed_layout(eng)
    assert [o.token_ids for o in eng.generate(prompts, params)] == want
    assert set(used) == {16, 32, 64} and sum(used.values()) > len(prompts), used


def test_steps_where_prompts_join_launched_ahead_through_mixed_layout(turnover_case):
    """Async scheduling launches a step in which prompts join before the last step's readback; through the
    padded layout its decode rows' ids are gathered on the device into the staged ids (prompt rows keep theirs):
    the outputs stay exact."""
    prompts, params, want = turnover_case
    eng = LLMEngine(EngineConfig(model=DEFAULT_MODEL, max_model_len=1024, device="cpu", max_num_seqs=4,
                                 max_num_batched_tokens=64, cuda_graph_num_tokens=[16, 32],
                                 async_scheduling=True))  # fmt: skip
    used = _through_mixed_layout(eng)
    assert [o.token_ids for o in eng.generate(prompts, params)] == want
    assert used.get("launched ahead", 0) >= 2, used


def test_dflash_engine_prefill_steps_through_mixed_layout(turnover_case):
    """DFlash reads the target layers' outputs of every prompt token (its context K/V): with prefill steps
    through the padded layout, outputs stay exact and drafts are accepted as often as eagerly."""
    prompts, params, want = turnover_case
    spec = {"method": "dflash", "model": "smollm2-135m-instruct-dflash", "num_speculative_tokens": 4,
            "execution": "decoupled"}  # fmt: skip
    runs, partial = [], []
    for padded in (False, True):
        # 64-token steps: prompts are chunked, and chunks that emit nothing yet take the padded layout too
        eng = spec_engine(spec, max_num_seqs=4, max_num_batched_tokens=64)
        used = _through_mixed_layout(eng) if padded else {}
        if padded:
            graphs = eng.executor.runner.mixed_graphs
            run = graphs.run
            graphs.run = lambda inp, *a, run=run: partial.append(not all(inp.samples)) or run(inp, *a)
        outs = [o.token_ids for o in eng.generate(prompts, params)]
        runs.append((outs, eng.spec_metrics.num_draft_tokens, eng.spec_metrics.num_accepted_tokens))
    assert runs[0][0] == runs[1][0] == want
    assert runs[0][1:] == runs[1][1:] and runs[1][2] > 0
    assert sum(used.values()) >= len(prompts) and any(partial), (used, partial)


@pytest.mark.gpu
def test_mixed_graphs_replayed_on_gpu_match_eager(turnover_case, monkeypatch):
    """On a GPU (fp32, so that eager and graph differ only by rounding): steps that prefill replay the captured
    graphs, and the outputs equal an eager engine's."""
    from flexspec.layers import fused

    # both engines unfused: with "auto" each would choose its skinny-GEMM rows from its own start-up timing
    monkeypatch.setattr(fused, "SKINNY", "off")
    prompts, params, _ = turnover_case
    cfg = EngineConfig(model=DEFAULT_MODEL, max_model_len=1024, device="cuda", dtype="float32", max_num_seqs=4,
                       max_num_batched_tokens=256)  # fmt: skip
    eager = LLMEngine(cfg.model_copy(update={"enforce_eager": True}))
    want = [o.token_ids for o in eager.generate(prompts, params)]
    del eager
    eng = LLMEngine(cfg)
    graphs = _runner(eng).mixed_graphs
    assert graphs is not None and graphs.graphs
    replays = {"n": 0}
    run = graphs.run
    graphs.run = lambda inp, *a: replays.__setitem__("n", replays["n"] + 1) or run(inp, *a)
    assert [o.token_ids for o in eng.generate(prompts, params)] == want
    assert replays["n"] >= -(-len(prompts) // 4)  # 4 sequences at a time: at least 3 steps prefill
