"""Lossless speculative verification by rejection sampling.

Terms (as in vLLM v1, vllm/v1/sample/rejection_sampler.py, whose output layout this follows):

* **accepted** tokens: the longest prefix of a sequence's draft tokens that passes the test below;
* **recovered** token: emitted at the first rejected position, sampled from the residual
  distribution ``norm(max(p - q, 0))`` (Leviathan et al., "Fast Inference from Transformers via
  Speculative Decoding", arXiv 2211.17192, Alg. 1; Chen et al., arXiv 2302.01318, Alg. 2);
* **bonus** token: emitted after the last draft when every draft was accepted, sampled from the
  target's distribution at that next position (given by the caller).

Draft ``x`` at a position is accepted iff ``u < min(1, p(x) / q(x))`` with ``u ~ U[0, 1)``, which
makes the emitted tokens exactly distributed as the target ``p``. With ``draft_probs=None`` the
drafts are deterministic (``q`` is one-hot at ``x``): accept with probability ``p(x)``, residual is
``p`` with ``x`` zeroed. Greedy sequences accept while ``x == argmax(p)`` and emit that argmax at
the first mismatch.

The recovered token is sampled without normalising or a cumulative sum via the exponential race
``argmax_i(r_i / E_i)`` with ``E_i ~ Exp(1)``: ``E_i / r_i ~ Exp(r_i)``, and the smallest of
independent exponentials is index ``i`` with probability ``r_i / sum(r)``. If the residual is all
zero (``p == q``) the race falls back to ``p``. All randomness is passed in, so both backends give
identical tokens for identical inputs.

Output: ``[S, max_spec_len + 1]`` int64, each row = accepted drafts, then the recovered or bonus
token, then ``-1`` padding (:data:`PLACEHOLDER_TOKEN_ID`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import Backend, use_triton

PLACEHOLDER_TOKEN_ID = -1


# ---------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------


@triton.jit
def _recovered_tokens_kernel(
    recovered_ptr,  # [N] int64 out: argmax(p) for greedy seqs, residual race otherwise
    draft_token_ids_ptr,  # [N] int64
    cu_num_draft_tokens_ptr,  # [S + 1] int32
    target_probs_ptr,  # [N, V] fp32
    draft_probs_ptr,  # [N, V] fp32 (unused unless HAS_DRAFT_PROBS)
    recovery_noise_ptr,  # [N, V] fp32, Exp(1)
    is_greedy_ptr,  # [S] uint8 (bool)
    vocab_size,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One program per (sequence, draft position): a streaming argmax over the vocabulary."""
    seq = tl.program_id(0)
    pos = tl.program_id(1)
    start = tl.load(cu_num_draft_tokens_ptr + seq)
    num_drafts = tl.load(cu_num_draft_tokens_ptr + seq + 1) - start
    if pos >= num_drafts:
        return
    idx = start + pos
    row = idx.to(tl.int64) * vocab_size
    greedy = tl.load(is_greedy_ptr + seq) != 0

    # Running (max, argmax) pairs; masked lanes get -1 so any real value (>= 0) beats them, and
    # only a strictly larger chunk max replaces the best so ties keep the first index (torch).
    best_r = tl.full([], -1.0, tl.float32)  # residual race
    best_r_idx = tl.full([], 0, tl.int64)
    best_p = tl.full([], -1.0, tl.float32)  # p race (greedy: plain argmax p; else fallback)
    best_p_idx = tl.full([], 0, tl.int64)
    if greedy:
        for v_start in range(0, vocab_size, BLOCK_V):
            offs = v_start + tl.arange(0, BLOCK_V)
            valid = offs < vocab_size
            p = tl.load(target_probs_ptr + row + offs, mask=valid, other=-1.0)
            chunk_max = tl.max(p, 0)
            if chunk_max > best_p:
                best_p = chunk_max
                best_p_idx = (v_start + tl.argmax(p, 0, tie_break_left=True)).to(tl.int64)
        token = best_p_idx
    else:
        draft = tl.load(draft_token_ids_ptr + idx)
        for v_start in range(0, vocab_size, BLOCK_V):
            offs = v_start + tl.arange(0, BLOCK_V)
            valid = offs < vocab_size
            p = tl.load(target_probs_ptr + row + offs, mask=valid, other=0.0)
            noise = tl.load(recovery_noise_ptr + row + offs, mask=valid, other=1.0)
            if HAS_DRAFT_PROBS:
                q = tl.load(draft_probs_ptr + row + offs, mask=valid, other=0.0)
                residual = tl.maximum(p - q, 0.0)
            else:
                residual = tl.where(offs == draft, 0.0, p)
            key_r = tl.where(valid, residual / noise, -1.0)
            key_p = tl.where(valid, p / noise, -1.0)
            chunk_max_r = tl.max(key_r, 0)
            if chunk_max_r > best_r:
                best_r = chunk_max_r
                best_r_idx = (v_start + tl.argmax(key_r, 0, tie_break_left=True)).to(tl.int64)
            chunk_max_p = tl.max(key_p, 0)
            if chunk_max_p > best_p:
                best_p = chunk_max_p
                best_p_idx = (v_start + tl.argmax(key_p, 0, tie_break_left=True)).to(tl.int64)
        token = tl.where(best_r > 0.0, best_r_idx, best_p_idx)  # all-zero residual: race on p
    tl.store(recovered_ptr + idx, token)


@triton.jit
def _rejection_sample_kernel(
    output_token_ids_ptr,  # [S, MAX_SPEC_LEN + 1] int64, pre-filled with -1
    draft_token_ids_ptr,  # [N] int64
    cu_num_draft_tokens_ptr,  # [S + 1] int32
    target_probs_ptr,  # [N, V] fp32
    draft_probs_ptr,  # [N, V] fp32 (unused unless HAS_DRAFT_PROBS)
    bonus_token_ids_ptr,  # [S] int64
    is_greedy_ptr,  # [S] uint8 (bool)
    uniform_samples_ptr,  # [N] fp32
    recovered_ptr,  # [N] int64
    vocab_size,
    HAS_DRAFT_PROBS: tl.constexpr,
    MAX_SPEC_LEN: tl.constexpr,
):
    """One program per sequence: walk its drafts until the first rejection."""
    seq = tl.program_id(0)
    start = tl.load(cu_num_draft_tokens_ptr + seq)
    # Never write past the row, even if the caller's max_spec_len is too small.
    num_drafts = tl.minimum(tl.load(cu_num_draft_tokens_ptr + seq + 1) - start, MAX_SPEC_LEN)
    greedy = tl.load(is_greedy_ptr + seq) != 0
    out_row = output_token_ids_ptr + seq.to(tl.int64) * (MAX_SPEC_LEN + 1)

    rejected = False
    for pos in range(num_drafts):
        if not rejected:
            idx = start + pos
            draft = tl.load(draft_token_ids_ptr + idx)
            recovered = tl.load(recovered_ptr + idx)
            if greedy:
                accept = draft == recovered  # recovered = argmax(p) for greedy seqs
            else:
                p_x = tl.load(target_probs_ptr + idx.to(tl.int64) * vocab_size + draft)
                if HAS_DRAFT_PROBS:
                    q_x = tl.load(draft_probs_ptr + idx.to(tl.int64) * vocab_size + draft)
                else:
                    q_x = 1.0
                u = tl.load(uniform_samples_ptr + idx)
                accept = (q_x > 0.0) & (u * q_x < p_x)  # u < min(1, p/q), division-free
            tl.store(out_row + pos, tl.where(accept, draft, recovered))
            rejected = not accept
    if not rejected:
        tl.store(out_row + num_drafts, tl.load(bonus_token_ids_ptr + seq))


def rejection_sample_triton(
    draft_token_ids: torch.Tensor,  # [N] int64
    cu_num_draft_tokens: torch.Tensor,  # [S + 1] int32
    target_probs: torch.Tensor,  # [N, V] fp32
    bonus_token_ids: torch.Tensor,  # [S] int64
    is_greedy: torch.Tensor,  # [S] bool
    uniform_samples: torch.Tensor,  # [N] fp32
    recovery_noise: torch.Tensor,  # [N, V] fp32
    draft_probs: torch.Tensor | None = None,  # [N, V] fp32
    max_spec_len: int | None = None,
) -> torch.Tensor:  # [S, max_spec_len + 1] int64
    """Triton launcher of :func:`rejection_sample`. Syncs only if ``max_spec_len`` is None."""
    _check_args(
        draft_token_ids, cu_num_draft_tokens, target_probs, bonus_token_ids, is_greedy,
        uniform_samples, recovery_noise, draft_probs,
    )  # fmt: skip
    max_spec_len = _resolve_max_spec_len(cu_num_draft_tokens, max_spec_len)
    num_seqs = bonus_token_ids.shape[0]
    num_drafts_total, vocab_size = target_probs.shape
    device = target_probs.device

    output = torch.full((num_seqs, max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    if num_seqs == 0:
        return output
    recovered = torch.empty(num_drafts_total, dtype=torch.int64, device=device)  # [N]
    is_greedy_u8 = is_greedy.view(torch.uint8)
    has_draft_probs = draft_probs is not None
    draft_probs_arg = draft_probs if has_draft_probs else target_probs  # dummy when unused
    if num_drafts_total > 0 and max_spec_len > 0:
        _recovered_tokens_kernel[(num_seqs, max_spec_len)](
            recovered, draft_token_ids, cu_num_draft_tokens, target_probs, draft_probs_arg,
            recovery_noise, is_greedy_u8, vocab_size,
            HAS_DRAFT_PROBS=has_draft_probs,
            BLOCK_V=min(triton.next_power_of_2(vocab_size), 1024),
        )  # fmt: skip
    _rejection_sample_kernel[(num_seqs,)](
        output, draft_token_ids, cu_num_draft_tokens, target_probs, draft_probs_arg,
        bonus_token_ids, is_greedy_u8, uniform_samples, recovered, vocab_size,
        HAS_DRAFT_PROBS=has_draft_probs,
        MAX_SPEC_LEN=max_spec_len,
    )  # fmt: skip
    return output


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def _residual(
    target_probs: torch.Tensor,  # [N, V] fp32
    draft_probs: torch.Tensor | None,  # [N, V] fp32
    draft_token_ids: torch.Tensor,  # [N] int64
) -> torch.Tensor:  # [N, V] fp32, unnormalised
    """``max(p - q, 0)``; for deterministic drafts (``q`` one-hot at the draft) ``p`` with it zeroed."""
    if draft_probs is None:
        return target_probs.scatter(1, draft_token_ids[:, None], 0.0)
    return (target_probs - draft_probs).clamp_min(0.0)


def rejection_sample_ref(
    draft_token_ids: torch.Tensor,  # [N] int64
    cu_num_draft_tokens: torch.Tensor,  # [S + 1] int32
    target_probs: torch.Tensor,  # [N, V] fp32
    bonus_token_ids: torch.Tensor,  # [S] int64
    is_greedy: torch.Tensor,  # [S] bool
    uniform_samples: torch.Tensor,  # [N] fp32
    recovery_noise: torch.Tensor,  # [N, V] fp32
    draft_probs: torch.Tensor | None = None,  # [N, V] fp32
    max_spec_len: int | None = None,
) -> torch.Tensor:  # [S, max_spec_len + 1] int64
    """Plain-torch reference (and CPU path) of :func:`rejection_sample`, vectorised over drafts."""
    _check_args(
        draft_token_ids, cu_num_draft_tokens, target_probs, bonus_token_ids, is_greedy,
        uniform_samples, recovery_noise, draft_probs,
    )  # fmt: skip
    max_spec_len = _resolve_max_spec_len(cu_num_draft_tokens, max_spec_len)
    num_seqs = bonus_token_ids.shape[0]
    num_drafts_total = draft_token_ids.shape[0]
    device = target_probs.device
    cu = cu_num_draft_tokens.long()
    num_drafts = cu[1:] - cu[:-1]  # [S]
    if num_seqs and int(num_drafts.max()) > max_spec_len:
        raise ValueError(f"a sequence has more than max_spec_len={max_spec_len} drafts")

    # Per draft: owning sequence, position within it, greedy flag.
    seq_of = torch.repeat_interleave(
        torch.arange(num_seqs, device=device), num_drafts, output_size=num_drafts_total
    )  # [N]
    pos = torch.arange(num_drafts_total, device=device) - cu[seq_of]  # [N]
    greedy = is_greedy[seq_of]  # [N]

    # Recovered token per draft position (used only at the first rejection).
    residual = _residual(target_probs, draft_probs, draft_token_ids)  # [N, V]
    residual = torch.where((residual > 0).any(-1, keepdim=True), residual, target_probs)
    recovered = torch.where(
        greedy,
        target_probs.argmax(-1),
        (residual / recovery_noise).argmax(-1),
    )  # [N]

    # Acceptance test per draft position.
    p_x = target_probs.gather(1, draft_token_ids[:, None])[:, 0]  # [N]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.gather(1, draft_token_ids[:, None])[:, 0]  # [N]
    accept_random = (q_x > 0) & (uniform_samples * q_x < p_x)  # u < min(1, p/q)
    accepted = torch.where(greedy, draft_token_ids == recovered, accept_random)  # [N]

    # A sequence accepts its drafts up to its first rejection.
    num_accepted = num_drafts.clone()  # [S]
    num_accepted.scatter_reduce_(0, seq_of[~accepted], pos[~accepted], reduce="amin")

    output = torch.full((num_seqs, max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    kept = pos < num_accepted[seq_of]  # [N]
    output[seq_of[kept], pos[kept]] = draft_token_ids[kept]
    any_rejected = num_accepted < num_drafts  # [S]
    first_rejected = (cu[:-1] + num_accepted).clamp_max(max(num_drafts_total - 1, 0))  # [S]
    final = (
        torch.where(any_rejected, recovered[first_rejected], bonus_token_ids)
        if num_drafts_total
        else bonus_token_ids
    )  # [S]
    output[torch.arange(num_seqs, device=device), num_accepted] = final
    return output


# ---------------------------------------------------------------------------------------------
# Dispatcher and helpers
# ---------------------------------------------------------------------------------------------


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [N] int64
    cu_num_draft_tokens: torch.Tensor,  # [S + 1] int32
    target_probs: torch.Tensor,  # [N, V] fp32
    bonus_token_ids: torch.Tensor,  # [S] int64
    is_greedy: torch.Tensor,  # [S] bool
    uniform_samples: torch.Tensor,  # [N] fp32
    recovery_noise: torch.Tensor,  # [N, V] fp32
    draft_probs: torch.Tensor | None = None,  # [N, V] fp32
    max_spec_len: int | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:  # [S, max_spec_len + 1] int64
    """Verify draft tokens against the target distribution (see the module docstring).

    Args:
        draft_token_ids: all draft tokens flattened; seq ``s`` owns
            ``[cu_num_draft_tokens[s], cu_num_draft_tokens[s + 1])`` (may be empty).
        cu_num_draft_tokens: cumulative draft counts.
        target_probs: target distribution at each draft position (already temperature / top-k /
            top-p processed).
        bonus_token_ids: token from the target after each sequence's last draft.
        is_greedy: per sequence, verify by argmax instead of by sampling.
        uniform_samples: ``U[0, 1)`` per draft for the acceptance test.
        recovery_noise: ``Exp(1)`` per draft and vocab entry for the recovered-token race.
        draft_probs: draft distribution ``q``; None means deterministic (one-hot) drafts.
        max_spec_len: largest number of drafts of any sequence; computed (one host sync) if None.
            Must not be smaller than the true maximum.
        backend: ``"auto"`` (Triton on CUDA, torch otherwise), ``"triton"`` or ``"torch"``.

    Returns:
        ``[S, max_spec_len + 1]`` int64: accepted drafts, then the recovered token (first
        rejection) or the bonus token (all accepted), padded with -1.
    """
    fn = rejection_sample_triton if use_triton(backend, target_probs) else rejection_sample_ref
    return fn(
        draft_token_ids, cu_num_draft_tokens, target_probs, bonus_token_ids, is_greedy,
        uniform_samples, recovery_noise, draft_probs, max_spec_len,
    )  # fmt: skip


def num_emitted(
    output_token_ids: torch.Tensor,  # [S, max_spec_len + 1] int64
) -> torch.Tensor:  # [S] int64
    """Tokens emitted per sequence (accepted drafts + 1 recovered or bonus token)."""
    return (output_token_ids != PLACEHOLDER_TOKEN_ID).sum(-1)


def _resolve_max_spec_len(cu_num_draft_tokens: torch.Tensor, max_spec_len: int | None) -> int:
    if max_spec_len is not None:
        if max_spec_len < 0:
            raise ValueError(f"max_spec_len must be >= 0, got {max_spec_len}")
        return max_spec_len
    if cu_num_draft_tokens.numel() <= 1:
        return 0
    return int((cu_num_draft_tokens[1:] - cu_num_draft_tokens[:-1]).max().item())  # host sync


def _check_args(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    is_greedy: torch.Tensor,
    uniform_samples: torch.Tensor,
    recovery_noise: torch.Tensor,
    draft_probs: torch.Tensor | None,
) -> None:
    """Shape / dtype / layout checks shared by both backends (no tensor values are read)."""
    if target_probs.dim() != 2 or target_probs.dtype != torch.float32:
        raise ValueError(
            f"target_probs must be float32 [N, V], got {target_probs.dtype} {tuple(target_probs.shape)}"
        )
    num_drafts_total, vocab_size = target_probs.shape
    num_seqs = bonus_token_ids.shape[0] if bonus_token_ids.dim() == 1 else -1
    expected = [
        ("draft_token_ids", draft_token_ids, (num_drafts_total,), torch.int64),
        ("cu_num_draft_tokens", cu_num_draft_tokens, (num_seqs + 1,), torch.int32),
        ("bonus_token_ids", bonus_token_ids, (num_seqs,), torch.int64),
        ("is_greedy", is_greedy, (num_seqs,), torch.bool),
        ("uniform_samples", uniform_samples, (num_drafts_total,), torch.float32),
        ("recovery_noise", recovery_noise, (num_drafts_total, vocab_size), torch.float32),
        ("target_probs", target_probs, (num_drafts_total, vocab_size), torch.float32),
    ]
    if draft_probs is not None:
        expected.append(("draft_probs", draft_probs, (num_drafts_total, vocab_size), torch.float32))
    for name, t, shape, dtype in expected:
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(
                f"{name} must be {dtype} of shape {shape} (N={num_drafts_total}, V={vocab_size}, "
                f"S={num_seqs}), got {t.dtype} {tuple(t.shape)}"
            )
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    devices = {t.device for _, t, _, _ in expected}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
