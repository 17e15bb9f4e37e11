"""Exact verification of draft tokens against the target (greedy at T=0, rejection sampling above).

Wraps ``flexspec_kernels.rejection_sample`` (Leviathan et al. 2211.17192; Chen et al. 2302.01318): builds the target
distribution with the same temperature / top-k / top-p processing as plain decoding, samples the bonus
token with the plain sampler, and draws all randomness from per-request seeds so results do not depend on
batching.
"""

from __future__ import annotations

import torch

from flexspec.engine.sampler import _SEED_STRIDE, SamplingMetadata, sample, target_probs
from flexspec.spec.tree import walk
from flexspec_kernels import rejection_sample

_UNIFORM_SALT = 0x5EED_0001
_RECOVERY_SALT = 0x5EED_0002


def _seeded(
    shape: tuple[int, ...], seeds: list[int], offsets: list[int], salt: int, kind: str, device
) -> torch.Tensor:
    out = torch.empty(shape, dtype=torch.float32, device=device)
    for i, (seed, off) in enumerate(zip(seeds, offsets)):
        gen = torch.Generator(device=device).manual_seed(
            (seed * _SEED_STRIDE + off + salt) & 0x7FFF_FFFF_FFFF_FFFF
        )
        if kind == "uniform":
            out[i].uniform_(generator=gen)
        else:
            out[i].exponential_(generator=gen)
    return out


def verify(
    logits: torch.Tensor,  # [N, V] target logits; seq s owns num_drafts[s] + 1 consecutive rows
    meta: SamplingMetadata,  # per logits row
    num_drafts: list[int],  # [S]
    draft_token_ids: list[list[int]],  # [S][num_drafts[s]]
    draft_probs: list[torch.Tensor | None] | None = None,  # [S] of [num_drafts[s], V] or None (deterministic)
    draft_parents: list[list[int] | None] | None = None,  # [S] draft trees (flexspec.spec.tree; None = chain)
) -> list[list[int]]:
    """Returns the emitted tokens per sequence: accepted drafts + one recovered or bonus token.

    Deterministic drafts (``draft_probs`` None: argmax / lookup drafters) and all-greedy batches take the
    sampled-target path: every row is sampled exactly as plain decoding samples that output position (argmax
    at T=0; at T>0 the Gumbel-max draw with the request's seed and the position's noise), a draft is accepted
    iff it equals that sample, and the first mismatch emits the sample. For a one-hot draft this is the
    rejection rule (P[accept] = p(draft); on rejection the sample is distributed as p without the draft,
    i.e. norm(max(p - q, 0))), and it makes seeded outputs identical with and without speculation, whatever
    mode the policy picks per step. Probabilistic drafts go through ``flexspec_kernels.rejection_sample``.
    """
    if draft_parents is not None and any(t is not None for t in draft_parents):
        if draft_probs is not None and any(p is not None for p in draft_probs):
            raise ValueError("draft trees need deterministic drafts (no draft_probs)")
        return _verify_by_target_sample(logits, meta, num_drafts, draft_token_ids, draft_parents)
    if meta.all_greedy or draft_probs is None or all(p is None for p in draft_probs):
        return _verify_by_target_sample(logits, meta, num_drafts, draft_token_ids)
    device = logits.device
    S = len(num_drafts)
    starts = [0]
    for d in num_drafts:
        starts.append(starts[-1] + d + 1)
    draft_rows = [starts[s] + j for s in range(S) for j in range(num_drafts[s])]
    bonus_rows = [starts[s] + num_drafts[s] for s in range(S)]
    rows_t = torch.tensor(bonus_rows, device=device)
    bonus_meta = meta.select(bonus_rows)
    bonus = sample(logits[rows_t], bonus_meta)  # [S]
    if not draft_rows:
        return [[t] for t in bonus.tolist()]

    d_idx = torch.tensor(draft_rows, device=device)
    N, V = len(draft_rows), logits.shape[-1]
    row_meta = meta.select(draft_rows)
    probs = target_probs(logits[d_idx], row_meta)  # [N, V]
    if meta.all_greedy:
        uniform = torch.zeros(N, dtype=torch.float32, device=device)
        noise = torch.ones(N, V, dtype=torch.float32, device=device)
    else:
        uniform = _seeded((N,), row_meta.seeds, row_meta.offsets, _UNIFORM_SALT, "uniform", device)
        noise = _seeded((N, V), row_meta.seeds, row_meta.offsets, _RECOVERY_SALT, "exponential", device)
    q = None
    if draft_probs is not None and any(p is not None for p in draft_probs):
        parts = []
        for s in range(S):
            if num_drafts[s] == 0:
                continue
            p = draft_probs[s]
            if p is None:  # deterministic draft: q is one-hot at the draft token
                ids = torch.tensor(draft_token_ids[s][: num_drafts[s]], device=device)
                p = torch.nn.functional.one_hot(ids, V).float()
            parts.append(p[: num_drafts[s]].to(device=device, dtype=torch.float32))
        q = torch.cat(parts)
    cu_list = [0]
    for d in num_drafts:
        cu_list.append(cu_list[-1] + d)
    cu = torch.tensor(cu_list, dtype=torch.int32, device=device)
    flat = torch.tensor([t for s in range(S) for t in draft_token_ids[s][: num_drafts[s]]], device=device)
    greedy = meta.temperature[rows_t] == 0
    out = rejection_sample(
        flat, cu, probs, bonus, greedy, uniform, noise, draft_probs=q, max_spec_len=max(num_drafts)
    )  # [S, max_d + 1]
    return [[t for t in row if t >= 0] for row in out.tolist()]


def _verify_by_target_sample(
    logits: torch.Tensor,
    meta: SamplingMetadata,
    num_drafts: list[int],
    draft_token_ids: list[list[int]],
    draft_parents: list[list[int] | None] | None = None,
) -> list[list[int]]:
    """logits [N, V], sequence s owns num_drafts[s] + 1 consecutive rows -> emitted tokens per sequence.
    A sequence with a draft tree (``draft_parents[s]``) walks it (``flexspec.spec.tree.walk``): its rows are
    the root's, then one per node, each sampled at the node's output position (``meta``'s offsets)."""
    target = sample(logits, meta).tolist()  # [N]: what plain decoding emits at each row's position
    out: list[list[int]] = []
    row = 0
    for s, (d, drafts) in enumerate(zip(num_drafts, draft_token_ids)):
        tree = draft_parents[s] if draft_parents is not None else None
        if tree is not None:
            out.append(walk(tree, drafts[:d], target[row : row + d + 1])[0])
            row += d + 1
            continue
        emitted = []
        for j in range(d + 1):
            emitted.append(target[row + j])
            if j == d or target[row + j] != drafts[j]:
                break
        out.append(emitted)
        row += d + 1
    return out


def accept_deterministic_drafts(
    target_tokens: torch.Tensor,  # [N] int64: what plain decoding samples at each logits row
    starts: torch.Tensor,  # [S] int64: first logits row of each sequence
    num_drafts: torch.Tensor,  # [S] int64: drafts verified per sequence (<= K)
    drafts: torch.Tensor,  # [S, K] int64: the drafts (columns past num_drafts ignored)
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [S, K + 1] int64, accepted [S] int64
    """The deterministic-draft rule of ``_verify_by_target_sample`` on the device, without a host sync.

    Sequence s owns logits rows ``starts[s] .. starts[s] + num_drafts[s]``. ``tokens[s, j]`` is the target's
    token at row j (rows past ``num_drafts[s]`` repeat the last one); ``accepted[s]`` = a is the number of
    leading drafts equal to it, so the step emits ``tokens[s, :a + 1]`` (a accepted drafts, then the recovered
    or bonus token ``tokens[s, a]``).
    """
    K = drafts.shape[1]
    j = torch.arange(K + 1, device=drafts.device)  # [K+1]
    rows = starts[:, None] + torch.minimum(j[None, :], num_drafts[:, None])  # [S, K+1]
    tokens = target_tokens[rows]  # [S, K+1]
    match = (tokens[:, :K] == drafts) & (j[None, :K] < num_drafts[:, None])  # [S, K]
    accepted = match.long().cumprod(1).sum(1)  # [S]
    return tokens, accepted
