"""The per-batch execution policy's warm-up profile: each mode's decode-step time at every batch-size bucket,
measured on dummy requests before serving (issue 6: "step times measured online, warm-up profile at start")."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from configs.sampling import SamplingParams

if TYPE_CHECKING:
    from flexspec.engine.llm_engine import LLMEngine

# Dummy request of the warm-up profile: ordinary instruction-following text (not from any evaluation set). At
# batch sizes from ``FULL_DRAFTS_FROM`` on its drafts are not cut by selective verification during the profile
# (``ModelInput.verify_all_drafts``, device-side steps): each option's steps verify as many drafts as the option
# allows, as in a real batch that large, where some request nearly always has a full chain and the step's graph is
# padded to it; acceptance stays ordinary (MAL ~2.3). Smaller batches keep the cut: the profile's requests are
# identical, so their step's longest query is each one's, as in a real step of one request. Session 36, H100:
# with the cut, chains of 3, 7 and 15 drafts all timed 2.82-2.87 ms at batch 64, where GSM8K's steps take 2.42 /
# 2.81 / 3.30 ms; with a count as the prompt (drafts accepted, MAL ~9-15) 2.96 / 3.37 / 4.09 ms (a step costs
# more the more drafts it accepts); uncut at batch 1, 15 drafts timed 1.59 ms against GSM8K's 1.35. Its acceptance
# is not kept (``SpeculationPolicy.finish_profile``).
FULL_DRAFTS_FROM = 16
_PROFILE_PROMPT = (
    "Explain step by step how to find the area of a triangle from the lengths of its three sides, then "
    "write a short Python function that does it and test it on a right triangle with sides 3, 4 and 5."
)


def _rounds(modes: list[str], steps_per_mode: int) -> list[list[tuple[str, int]]]:
    """(mode, steps) of the profile at one bucket, in rounds that each start from freshly prefilled dummy
    requests, so that every speculative mode is timed over the same context lengths (prompt + a few dozen
    tokens; with one set of requests for all of them, each mode ran at longer contexts than the one before:
    at batch 64 on an H100, chains of 15 drafts timed 4.09 ms where GSM8K's take 3.30, session 36).
    ``modes[0]`` is plain decoding; every mode runs ``steps_per_mode`` + 2 steps (its first is a switch step),
    after one plain step in each round but the first (which times plain decoding), and is followed by one
    plain step (leaving it), so both switch steps of every speculative mode are timed."""
    return [
        [(modes[0], steps_per_mode + 2 if i == 0 else 1), (mode, steps_per_mode + 2), (modes[0], 1)]
        for i, mode in enumerate(modes[1:])
    ]


def profile_speculation(
    engine: LLMEngine, steps_per_mode: int, max_batch_size: int | None = None
) -> dict[str, float]:
    """Warm-up profile of the per-batch execution policy (issue 6: "step times measured online, warm-up
    profile at start"): at every batch-size bucket (1, 2, 4, ... up to ``max_batch_size``, default
    ``max_num_seqs``; buckets whose requests would not fit the KV cache are skipped) run that many dummy
    requests (greedy, EOS ignored) and time ``steps_per_mode`` decode steps of each execution mode the
    policy can choose (forced), with the same per-step timing the policy uses online. Each (mode, bucket)
    then starts from the median (``SpeculationPolicy.finish_profile``), so the policy need not explore
    while serving. Engine statistics, speculative metrics and the seed stream are left as before.

    Returns {"mode@bucket": median step time in ms}. Call before serving (no other requests queued)."""
    policy = engine.policy
    if policy is None or engine.has_unfinished:
        raise RuntimeError("profile_speculation needs a speculative engine with no requests in flight")
    cfg = engine.config
    prompt = engine.encode(_PROFILE_PROMPT)
    if getattr(engine.tokenizer, "chat_template", None):
        prompt = engine.apply_chat_template([{"role": "user", "content": _PROFILE_PROMPT}])
    k = policy.max_chain_drafts  # the most tokens a step emits, less 1 (a tree's depth, not its node count)
    modes = list(policy.options)
    room = cfg.max_model_len - len(prompt) - 1
    max_tokens = min((2 * steps_per_mode + 5) * (k + 1) + 8, room)  # one round
    capacity = engine.block_manager.num_free_blocks * cfg.kv_block_size
    limit = min(max_batch_size or cfg.max_num_seqs, cfg.max_num_seqs)
    sizes, b = [], 1
    while b < 2 * limit and b > 0:
        size = min(b, limit)
        if max_tokens < 1 or size * (len(prompt) + max_tokens + 2 * cfg.kv_block_size) > capacity:
            break
        sizes.append(size)
        b *= 2
    if not sizes:  # the dummy request does not fit: the policy measures online only
        return policy.finish_profile()
    saved = (engine._rng.getstate(), copy.deepcopy(engine.stats), copy.deepcopy(engine.spec_metrics))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids: list[str] = []
    try:
        for size in sizes:
            policy.forced_full_drafts = size >= FULL_DRAFTS_FROM
            for phases in _rounds(modes, steps_per_mode):
                ids = [
                    engine.add_request(prompt, params, f"flexspec-profile-{size}-{i}") for i in range(size)
                ]
                policy.forced = modes[0]
                while engine.has_unfinished and any(  # prefill
                    not engine.seqs[i].output_token_ids for i in ids if i in engine.seqs
                ):
                    engine.step()
                # a mode's first step is a switch step (timed as one, SpeculationPolicy.switch_time)
                for mode, steps in phases:
                    policy.forced = mode
                    for _ in range(steps):
                        if not engine.has_unfinished:
                            break
                        engine.step()
                for i in ids:
                    engine.abort(i)
                while engine.has_unfinished:
                    engine.step()
    finally:
        for i in ids:  # no-op unless a step raised
            engine.abort(i)
        engine._rng.setstate(saved[0])
        engine.stats, engine.spec_metrics = saved[1], saved[2]
        profile = policy.finish_profile()
    return profile
