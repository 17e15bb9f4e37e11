"""Row-wise argmax of logits (greedy sampling) in one Triton launch.

``torch.argmax`` over one row of a 49,152-entry vocabulary runs one reduction kernel that took 13 us per decode
step on the H200 (session 19 profile: the longest single non-GEMM launch of a batch-1 step). Here one
program per row streams the row in ``BLOCK``-wide tiles, keeping a running maximum and its first index per lane,
then reduces the lanes: ties go to the lowest index, as ``torch.argmax`` does. NaN entries are skipped (torch
would return a NaN's index); logits with NaN are a broken model either way.

H200, session 20, in a CUDA graph ([N, 49152] fp32; ``bench/results/h200-2026-12-03-s20/argmax/argmax.json``, the
sweep ``python -m bench.kernels_bench --argmax`` runs): torch 11.8 / 12.2 / 12.3 us at N = 1 / 8 / 64, this kernel
with 8192-wide tiles and 8 warps 4.4 / 4.6 / 4.9 us (other tile / warp choices: 4.7-18.9 us).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import Backend, use_triton
from .pdl import CHAIN_ROWS as PDL_CHAIN_ROWS
from .pdl import launch_options, pdl_launch, pdl_wait


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, V, stride, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_idx = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + lanes
        v = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        better = v > best  # strict: a lane keeps its first maximum
        best = tl.where(better, v, best)
        best_idx = tl.where(better, offs, best_idx)
    top = tl.max(best, 0)
    idx = tl.min(tl.where(best == top, best_idx, V), 0)  # the lowest index holding the maximum
    idx = tl.where(idx == V, 0, idx)  # no finite entry beat -inf anywhere: index 0, as torch
    tl.store(out_ptr + row, idx.to(tl.int64))


def argmax_triton(x: torch.Tensor, block: int = 8192, num_warps: int = 8) -> torch.Tensor:
    """Triton launcher of :func:`argmax`: ``x`` [N, V] (unit stride along V) -> [N] int64."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [N, V] with unit stride along V, got {tuple(x.shape)} {x.stride()}")
    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    if x.shape[0] and x.shape[1]:
        pdl = x.shape[0] <= PDL_CHAIN_ROWS and pdl_launch(x)  # decode at batch <= 4 (as measured, pdl.py)
        _argmax_kernel[(x.shape[0],)](
            x,
            out,
            x.shape[1],
            x.stride(0),
            BLOCK=block,
            USE_PDL=pdl,
            num_warps=num_warps,
            **launch_options(pdl),
        )
    elif x.shape[0]:
        raise ValueError("argmax of an empty row")
    return out


def argmax(x: torch.Tensor, backend: Backend = "auto") -> torch.Tensor:
    """Index of each row's maximum: ``x`` [N, V] float -> [N] int64, the lowest index among ties (as
    ``torch.argmax(x, dim=-1)``, whose result the torch path returns). ``backend="auto"``: Triton for CUDA
    tensors [N, V > 0] with unit stride along V, torch otherwise; ``"triton"`` raises ValueError for other
    shapes."""
    if backend == "auto":
        if x.is_cuda and x.dim() == 2 and x.shape[1] > 0 and x.stride(1) == 1:
            return argmax_triton(x)
        return x.argmax(dim=-1)
    if use_triton(backend, x):
        return argmax_triton(x)
    return x.argmax(dim=-1)
