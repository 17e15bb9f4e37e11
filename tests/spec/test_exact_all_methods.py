"""Issue 3 acceptance, for every speculative method: at T=0 the token ids with speculation equal plain greedy
decoding's, token for token, on the 21 real prompts x 128 tokens of ``plain_128`` (fp32, CPU, default model).

All 21 prompts are submitted at once to an engine with ``max_num_seqs=8``: mixed prompt lengths, sequences
joining a running batch as others finish, multi-token steps in a batch. Every method drafts on every step
(``execution: decoupled``; FlexDraft also ``parallel``).

Drafters: n-gram runs as is (real prompt-lookup drafts). The others go through ``oracle_drafts``, which replaces
a varying number (0..k) of each proposal's leading drafts by the true continuation and leaves the rest the
drafter's own: accepted runs of every length, rejections at every position and the drafter's state after
partial acceptance all occur, and steps are fewer (this module must stay cheap on 2 CPU cores). dflash and
flexdraft use the shipped trained drafters, whose own drafts must also be right sometimes (checked before the
oracle touches them); dspark and eagle3 use their own tests' random-init checkpoints, draft_model test_mtp's
random 2-layer Llama with the default tokenizer (a target-sized draft model costs as much as the target per
draft token; self-drafting is tested in test_draft_model / test_stop_conditions) and mtp random MTP weights
for the default model: their own drafts are legitimately ~never right.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from configs import SamplingParams
from tests.spec.conftest import histories_after, on_worker_outputs, spec_engine
from tests.spec.test_dspark import dspark_dir  # noqa: F401  (random-init DSpark checkpoint, block 4)
from tests.spec.test_eagle3 import eagle_dir  # noqa: F401  (random-init EAGLE-3 checkpoint)
from tests.spec.test_mtp import tiny_target  # noqa: F401  (random 2-layer Llama, the default tokenizer)

pytestmark = pytest.mark.slow  # among the longest modules: scheduled first

MAX_TOKENS = 128
MAX_NUM_SEQS = 8
MAX_MODEL_LEN = 512  # longest prompt (140) + 128 tokens + drafts
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)


@pytest.fixture(scope="module")
def mtp_dir(engine, tmp_path_factory) -> Path:
    """Random MTP weights for the default model in the Qwen3-Next layout (``mtp.*``, the target's LM head), in
    a folder passed as ``speculative_config.model`` (the default model's checkpoint has no MTP layers)."""
    s = engine.spec
    H, I, q, kv = s.hidden_size, s.intermediate_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    g = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.05

    layer = {
        "self_attn.q_proj.weight": w(q, H),
        "self_attn.k_proj.weight": w(kv, H),
        "self_attn.v_proj.weight": w(kv, H),
        "self_attn.o_proj.weight": w(H, q),
        "mlp.gate_proj.weight": w(I, H),
        "mlp.up_proj.weight": w(I, H),
        "mlp.down_proj.weight": w(H, I),
        "input_layernorm.weight": torch.ones(H),
        "post_attention_layernorm.weight": torch.ones(H),
    }
    top = {"pre_fc_norm_embedding.weight": torch.ones(H), "pre_fc_norm_hidden.weight": torch.ones(H),
           "fc.weight": w(H, 2 * H), "norm.weight": torch.ones(H)}  # fmt: skip
    tensors = {"mtp." + k: t for k, t in top.items()} | {"mtp.layers.0." + k: t for k, t in layer.items()}
    folder = tmp_path_factory.mktemp("mtp_default_model")
    save_file(tensors, str(folder / "mtp.safetensors"))
    (folder / "config.json").write_text(json.dumps({"mtp_num_hidden_layers": 1}))
    return folder


@contextlib.contextmanager
def oracle_drafts(eng, prompts: list[list[int]], ref: list[list[int]]):
    """While active, the first ``keep`` drafts of every proposal are replaced by the true continuation;
    ``keep`` in 0..k varies with (sequence, length): each of 0..k-1 with probability 1/(3k), k with the rest
    (full runs are the cheap ones; a rejection at every position still occurs dozens of times per case).
    Yields a dict: ``own`` counts the drafter's own correct leading drafts, ``replaced`` the drafts replaced."""
    worker = eng.executor.runner.spec_worker
    truth = [list(p) + list(r) for p, r in zip(prompts, ref)]
    stats = {"own": 0, "replaced": 0}

    def oracle(inp, out) -> None:  # drafts are replaced where the worker hands them to the engine (all paths)
        if not out.draft_token_ids:
            return
        for (sid, hist), drafts in zip(histories_after(worker, inp, out).items(), out.draft_token_ids):
            n = len(hist)
            seq = next((t for t in truth if t[:n] == hist), None)
            if not drafts or seq is None:
                continue
            right = seq[n : n + len(drafts)]
            own = next(
                (j for j, (d, t) in enumerate(zip(drafts, right)) if d != t), min(len(drafts), len(right))
            )
            stats["own"] += own
            keep = min(hash((sid, n)) % (3 * len(drafts)), len(drafts), len(right))
            stats["replaced"] += keep
            drafts[:keep] = right[:keep]

    with on_worker_outputs(worker, oracle):
        yield stats


DECOUPLED = {"execution": "decoupled"}
FLEXDRAFT = {"method": "flexdraft", "model": "smollm2-135m-instruct-flexdraft", "num_speculative_tokens": 3}

# id -> (speculative_config, fixture giving "model" or None, oracle: None | "trained" | "random")
CASES = {
    "ngram": ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, **DECOUPLED}, None, None),
    "draft_model": ({"method": "draft_model", "num_speculative_tokens": 4, **DECOUPLED}, "tiny_target", "random"),
    "dflash": ({"method": "dflash", "model": "smollm2-135m-instruct-dflash", "num_speculative_tokens": 3,
                **DECOUPLED}, None, "trained"),
    "dspark": ({"method": "dspark", "verification_threshold": 0.0, **DECOUPLED}, "dspark_dir", "random"),
    "eagle3": ({"method": "eagle3", "num_speculative_tokens": 3, **DECOUPLED}, "eagle_dir", "random"),
    "mtp": ({"method": "mtp", "num_speculative_tokens": 3, **DECOUPLED}, "mtp_dir", "random"),
    "flexdraft-parallel": ({**FLEXDRAFT, "execution": "parallel"}, None, "trained"),
    "flexdraft-decoupled": ({**FLEXDRAFT, "execution": "decoupled"}, None, "trained"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_t0_exact_on_21_prompts_x_128_tokens_batch_8(request, plain_128, case):
    spec, ckpt_fixture, oracle = CASES[case]
    if ckpt_fixture is not None:
        spec = {**spec, "model": str(request.getfixturevalue(ckpt_fixture))}
    prompts, ref = plain_128
    assert len(prompts) >= 20 and sum(map(len, ref)) > 20 * 100
    eng = spec_engine(spec, max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS)
    with oracle_drafts(eng, prompts, ref) if oracle else contextlib.nullcontext({}) as stats:
        outs = eng.generate(prompts, GREEDY)
    got = [o.token_ids for o in outs]
    bad = [i for i, (a, b) in enumerate(zip(got, ref)) if a != b]
    first = [
        next((j for j, (x, y) in enumerate(zip(got[i], ref[i])) if x != y), min(len(got[i]), len(ref[i])))
        for i in bad
    ]
    assert len(got) == len(ref) and not bad, f"{case}: prompts {bad} differ from position {first} on"
    m = eng.spec_metrics
    assert m.num_drafts > 0 and 0 < m.num_accepted_tokens < m.num_draft_tokens, m.as_dict()
    assert len(m.num_accepted_tokens_per_pos) >= 3 and all(m.num_accepted_tokens_per_pos), m.as_dict()
    assert set(eng.policy.mode_counts) == {spec["execution"]}, eng.policy.mode_counts
    if oracle:
        assert stats["replaced"] > 0, stats
    if oracle == "trained":  # the trained drafter's own drafts are right often enough on real prompts
        assert stats["own"] > 0.1 * m.num_drafts, (stats, m.as_dict())
