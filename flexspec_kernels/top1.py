"""Each row's top-1 token and its softmax probability in one pass over the logits (a drafter's greedy drafts
and the confidence that selective verification cuts them by).

The torch path, ``logits.float().softmax(-1).max(-1)``, reads and writes the [N, V] logits several times: the
fp32 copy of the LM head's bf16 output, the softmax (read, write), the max (read). With a DFlash drafter's
block of 15 drafts at batch 64 (N = 960 rows of 49,152) those three took 0.58 of the step's 2.5 ms of kernels
on an H100 (session 36, ``scripts/profile_spec_step.py``). Here one program per row streams the row once in
``BLOCK``-wide tiles, keeping per lane a running maximum, its first index and the sum of ``exp(x - max)``
rescaled as the maximum grows (the online softmax normaliser of Milakov & Gimelshein, arXiv 1805.02867), then
combines the lanes: the top probability is ``1 / sum_j exp(x_j - max)``. The input may be bf16 / fp16 / fp32;
values are upcast to fp32 in registers. Ties go to the lowest index (as ``torch.max`` and ``torch.argmax``);
-inf entries count as probability 0; a row of only -inf gets index 0 and probability NaN (torch's softmax gives
NaN there too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import Backend, use_triton


@triton.jit
def _top1_softmax_kernel(x_ptr, prob_ptr, idx_ptr, V, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride
    lanes = tl.arange(0, BLOCK)
    run_max = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros([BLOCK], dtype=tl.float32)  # sum of exp(x - run_max) over the lane's entries so far
    run_idx = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + lanes
        v = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(run_max, v)
        # a lane still at -inf has nothing to rescale or add; subtracting 0 there keeps -inf - -inf out
        shift = tl.where(new_max > float("-inf"), new_max, 0.0)
        run_sum = run_sum * tl.exp(run_max - shift) + tl.exp(v - shift)
        run_idx = tl.where(v > run_max, offs, run_idx)  # strict: a lane keeps its first maximum
        run_max = new_max
    top = tl.max(run_max, 0)
    total = tl.sum(run_sum * tl.exp(run_max - tl.where(top > float("-inf"), top, 0.0)), 0)
    idx = tl.min(tl.where(run_max == top, run_idx, V), 0)  # the lowest index holding the maximum
    idx = tl.where(idx == V, 0, idx)  # an all -inf row: index 0, as torch
    prob = tl.where(total > 0, 1.0 / tl.where(total > 0, total, 1.0), float("nan"))
    tl.store(prob_ptr + row, prob)
    tl.store(idx_ptr + row, idx.to(tl.int64))


def top1_softmax_triton(
    x: torch.Tensor, block: int = 4096, num_warps: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher of :func:`top1_softmax`: ``x`` [N, V] (unit stride along V) -> (prob [N] fp32,
    index [N] int64). Raises ValueError for other layouts or empty rows."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [N, V] with unit stride along V, got {tuple(x.shape)} {x.stride()}")
    if x.shape[0] and not x.shape[1]:
        raise ValueError("top-1 of an empty row")
    prob = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    idx = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    if x.shape[0]:
        _top1_softmax_kernel[(x.shape[0],)](
            x, prob, idx, x.shape[1], x.stride(0), BLOCK=block, num_warps=num_warps
        )
    return prob, idx


def top1_softmax_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference: ``x.float().softmax(-1).max(-1)`` as (prob [N] fp32, index [N] int64)."""
    prob, idx = x.float().softmax(-1).max(-1)
    return prob, idx


def top1_softmax(x: torch.Tensor, backend: Backend = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Top-1 softmax probability and token of each row: ``x`` [N, V] logits (bf16 / fp16 / fp32) -> (prob
    [N] fp32, index [N] int64), equal to ``x.float().softmax(-1).max(-1)`` (probabilities to fp32 rounding:
    the sum runs in another order; indices exactly, the lowest among ties). ``backend="auto"``: Triton for
    CUDA tensors [N, V > 0] with unit stride along V, the torch reference otherwise; ``"triton"`` raises
    ValueError for other layouts. Sync-free (captured in the drafters' CUDA graphs)."""
    if backend == "auto":
        if x.is_cuda and x.dim() == 2 and x.shape[1] > 0 and x.stride(1) == 1:
            return top1_softmax_triton(x)
        return top1_softmax_ref(x)
    if use_triton(backend, x):
        return top1_softmax_triton(x)
    return top1_softmax_ref(x)
