"""Split-K form of the few-row fused GEMM (``flexspec_kernels.skinny_linear``, ``variant="splitk"``; opt-in).

``y = x @ W^T`` for ``x`` [M, K] (M <= 16), ``W`` [N, K] ([2d, K] ``[gate | up]`` with an activation), with
the dot form's fusions (RMSNorm of ``x``, bias, SwiGLU / GeGLU, residual add in place, capture). The dot form
runs one program per BLOCK_N output features: 36-192 programs for a 135M model's GEMMs, on 132 SMs. Here the
grid is (cdiv(N, BLOCK_N), SPLIT_K): program (j, s) multiplies rows 0..M of ``x`` by the features' [BLOCK_N,
CHUNK] slice of ``W`` at K offset ``s * CHUNK`` (one ``tl.dot`` of [16, BLOCK_K] x [BLOCK_K, BLOCK_N]), so the
same GEMM runs on SPLIT_K times as many programs, each reading a small piece of ``W``.

The partial sums are reduced in place, as CUTLASS's serial split-K (``gemm::kernel::Gemm`` with
``SplitKSerial``, ordered by ``cutlass/semaphore.h``) and the "stream-K" fix-up (Osama et al., arXiv
2301.03598) do it, with atomics instead of CUTLASS's turn-taking: each program adds its fp32 [M, BLOCK_N]
partial (and the up half's) into a workspace with ``tl.atomic_add``, then, after a CTA barrier, increments its
feature tile's int32 arrival counter (``acq_rel``, GPU scope). The program that reads ``SPLIT_K - 1`` (the
last to arrive) takes the full sums back with ``tl.atomic_xchg(..., 0)`` (atomics act at L2: never a stale L1
line), which also leaves its tile of the workspace zero, resets the counter to 0, and runs the dot form's
epilogue (``_dot_epilogue``: bias, rounding, activation, residual, capture). Memory ordering, as CUTLASS's
``Semaphore``: every thread's partial adds come before the barrier, the barrier before thread 0's release (the
counter increment), the last arriver's acquire (its increment) before the barrier that hands the count to its
threads, and that barrier before their reads.

The workspace (fp32, ``MAX_ROWS`` x the weight's rows) and counters (one per 16 features) are one per device,
zero between launches (each launch leaves them zero), shared by every split-K GEMM on that device. That holds
because launches on one stream are ordered: with PDL (``flexspec_kernels.pdl``) every access to them and every
read of ``x`` / ``residual`` comes after ``pdl_wait``, which orders a grid after the previous grid's
completion, and only the weights (constant) are loaded before it. Two split-K GEMMs running at once on
different streams of one device would share it: not supported. Grown (never shrunk) by a call that needs more,
on the caller's current stream; never during a CUDA-graph capture (the buffer would come from the graph's
private pool and its zero fill would be a node of the graph): call :func:`reserve_splitk_workspace` (or one
eager call per shape) before capturing. Outgrown buffers are kept alive, since graphs captured earlier still
point at them.

Costs against the dot form: every program reads its rows' whole ``x`` for the norm's rstd (``x`` is a few KB,
from L2), and the fp32 atomics add the partials in arrival order: the sums' last bits, hence at times a
rounded output, may differ from run to run on a GPU (the dot form is bitwise reproducible).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch_options, pdl_wait
from .skinny_linear import MAX_ROWS, _dot, _dot_epilogue

SPLITK_BLOCK_N = 16  # features per program (tl.dot needs >= 16)
SPLITK_MIN_BLOCK_N = 16  # smallest block_n the workspace's counters are sized for

# device -> (fp32 workspace, int32 counters); both all zero between launches
_WORKSPACES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_RETIRED: list[tuple[torch.Tensor, torch.Tensor]] = []  # outgrown: CUDA graphs may still point at them


def _norm_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def splitk_workspace(device: torch.device | str, max_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The device's (workspace [>= MAX_ROWS * max_n] fp32, counters [>= cdiv(max_n, 16)] int32), zero, grown
    (``torch.zeros``, on the current stream) when smaller. ``max_n``: the weight's rows (2d with an
    activation). Raises RuntimeError when it must grow during a CUDA-graph capture."""
    device = _norm_device(device)
    need_ws, need_cnt = MAX_ROWS * max_n, triton.cdiv(max_n, SPLITK_MIN_BLOCK_N)
    cur = _WORKSPACES.get(device)
    if cur is not None and cur[0].numel() >= need_ws and cur[1].numel() >= need_cnt:
        return cur
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        have = 0 if cur is None else min(cur[0].numel() // MAX_ROWS, cur[1].numel() * SPLITK_MIN_BLOCK_N)
        raise RuntimeError(
            f"the split-K workspace on {device} holds {have} features, this GEMM needs {max_n}, and it can't "
            "grow during CUDA-graph capture: call flexspec_kernels.skinny_splitk.reserve_splitk_workspace("
            "device, max_rows, max_n) (or run each shape once) before capturing"
        )
    if cur is not None:
        need_ws, need_cnt = max(need_ws, cur[0].numel()), max(need_cnt, cur[1].numel())
        _RETIRED.append(cur)
    ws = torch.zeros(need_ws, dtype=torch.float32, device=device)
    cnt = torch.zeros(need_cnt, dtype=torch.int32, device=device)
    _WORKSPACES[device] = (ws, cnt)
    return ws, cnt


def reserve_splitk_workspace(
    device: torch.device | str, max_rows: int, max_n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-sizes ``device``'s split-K workspace for GEMMs of up to ``max_rows`` rows (at most ``MAX_ROWS``;
    the workspace is sized for ``MAX_ROWS`` regardless) and ``max_n`` weight rows (2d for a ``[gate | up]``
    weight): call it before capturing CUDA graphs that run the split-K form. Returns (workspace, counters)."""
    if not 0 < max_rows <= MAX_ROWS:
        raise ValueError(f"max_rows must be in 1..{MAX_ROWS}, got {max_rows}")
    return splitk_workspace(device, max_n)


@triton.jit
def _take(ptrs, mask):
    """The fp32 values at ``ptrs`` (0 where masked), leaving 0 there: an atomic exchange, on the bits as int32
    (the interpreter exchanges no floats), so the read comes from L2 and not a stale cache line."""
    bits = tl.atomic_xchg(ptrs.to(tl.pointer_type(tl.int32)), 0, mask=mask, sem="relaxed")
    return tl.where(mask, bits.to(tl.float32, bitcast=True), 0.0)


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every row count
def _skinny_splitk_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] ([2N, K] with ACT >= 0: gate rows then up rows)
    b_ptr,  # [N] (HAS_BIAS)
    nw_ptr,  # [K] (NORM > 0)
    res_ptr,  # [M, N] (RESIDUAL; also the output)
    out_ptr,  # [M, N]
    cap_ptr,  # [M, N] (CAPTURE)
    cache_ptr,  # [num_slots + 1, C] (CAPTURE)
    slot_ptr,  # [M] int64 (CAPTURE)
    ws_ptr,  # fp32 [M, N] sums (then [M, N] of the up half with ACT >= 0); zero between launches
    cnt_ptr,  # int32 [cdiv(N, BLOCK_N)] arrivals per feature tile; zero between launches
    M,
    N,
    K,
    CHUNK,  # K per program (<= BLOCK_K); program s covers s * CHUNK .. min((s + 1) * CHUNK, K)
    x_stride,
    w_stride,
    res_stride,
    out_stride,
    cap_stride,
    cache_stride,
    cache_col,
    scratch_row,
    eps,
    HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr,  # 0 none, 1 w, 2 (1 + w)
    ACT: tl.constexpr,  # -1 none, 0 silu, 1 gelu_tanh
    RESIDUAL: tl.constexpr,
    CAPTURE: tl.constexpr,  # 0 none, 1 copy to cap_ptr, 2 also the feature-cache rows
    DOT: tl.constexpr,  # as the dot form's
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM_BLOCK: tl.constexpr,  # K step of the norm's sum of squares over the whole row
    USE_PDL: tl.constexpr = False,  # launched with programmatic dependent launch (``flexspec_kernels.pdl``)
):
    pid_n = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    kk = tl.program_id(1) * CHUNK + rk
    k_mask = (rk < CHUNK) & (kk < K)
    m_mask = rm < M
    n_mask = rn < N
    # constant inputs first: with PDL they load while the previous grid finishes
    w_rows = w_ptr + rn[:, None].to(tl.int64) * w_stride + kk[None, :]
    w = tl.load(w_rows, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    if ACT >= 0:
        wu = tl.load(w_rows + N * w_stride, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    if NORM > 0:
        nw = tl.load(nw_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
        if NORM == 2:
            nw = nw + 1.0
    pdl_wait(USE_PDL)  # x, the residual, the workspace and the counters: only after the previous grid
    x_rows = x_ptr + rm[:, None].to(tl.int64) * x_stride
    xv = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
    if NORM > 0:  # rstd over the whole row, in every program (x is a few KB)
        rs = tl.arange(0, NORM_BLOCK)
        sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, NORM_BLOCK):
            xs = tl.load(
                x_rows + (k0 + rs)[None, :], mask=m_mask[:, None] & (k0 + rs < K)[None, :], other=0.0
            )
            xs = xs.to(tl.float32)
            sum_sq += tl.sum(xs * xs, axis=1)
        rstd = 1.0 / tl.sqrt(sum_sq / K + eps)
        xv = ((xv.to(tl.float32) * rstd[:, None]) * nw[None, :]).to(w_ptr.dtype.element_ty)
    mask = m_mask[:, None] & n_mask[None, :]
    ws_tile = ws_ptr + rm[:, None] * N + rn[None, :]
    tl.atomic_add(ws_tile, _dot(xv, tl.trans(w), DOT), mask=mask, sem="relaxed")
    if ACT >= 0:
        tl.atomic_add(ws_tile + M * N, _dot(xv, tl.trans(wu), DOT), mask=mask, sem="relaxed")
    # every thread's adds before the release below (the scalar atomic is issued by one thread; Triton hands
    # its result to the others through shared memory after a barrier)
    tl.debug_barrier()
    count = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
    if count == tl.num_programs(1) - 1:  # the last arriver: every partial is in; read, leave zero, finish
        acc = _take(ws_tile, mask)
        acc_up = acc
        if ACT >= 0:
            acc_up = _take(ws_tile + M * N, mask)
        tl.store(cnt_ptr + pid_n, 0)
        _dot_epilogue(
            acc, acc_up, rm, rn, m_mask, n_mask, b_ptr, res_ptr, out_ptr, cap_ptr, cache_ptr, slot_ptr,
            res_stride, out_stride, cap_stride, cache_stride, cache_col, scratch_row,
            HAS_BIAS, ACT, RESIDUAL, CAPTURE,
        )  # fmt: skip


def splitk_tiles(k: int, block_k: int | None, split_k: int | None) -> tuple[int, int, int]:
    """(BLOCK_K, CHUNK, SPLIT_K) for a reduction of ``k``: without ``split_k``, chunks of ``block_k`` (default
    64, 128 from K = 1024 on); with it, ``cdiv(k, split_k)`` rounded up to 16 (aligned loads) per program and
    BLOCK_K that, padded to a power of 2 (or ``block_k``, which must cover it). SPLIT_K = cdiv(k, CHUNK): the
    last chunk may be ragged (masked), and may end up fewer than ``split_k``."""
    if block_k is not None and (block_k < 16 or block_k & (block_k - 1)):
        raise ValueError(f"block_k must be a power of 2 >= 16, got {block_k}")
    if split_k is None:
        bk = block_k or (128 if k >= 1024 else 64)
        chunk = bk
    else:
        if split_k < 1:
            raise ValueError(f"split_k must be >= 1, got {split_k}")
        chunk = triton.cdiv(triton.cdiv(k, split_k), 16) * 16
        bk = block_k or max(16, triton.next_power_of_2(chunk))
        if bk < chunk:
            raise ValueError(f"block_k={bk} is smaller than a chunk of K={k} split {split_k} ways ({chunk})")
    return bk, chunk, triton.cdiv(k, chunk)


def launch_splitk(
    ptrs: tuple,
    sizes: tuple[int, int, int],
    strides: tuple,
    flags: dict,
    *,
    DOT: int,
    block_n: int | None,
    block_k: int | None,
    split_k: int | None,
    num_warps: int,
    pdl: bool,
) -> None:
    """Launches :func:`_skinny_splitk_kernel` with ``skinny_linear_triton``'s checked arguments (``ptrs``: x,
    weight, ..., slot mapping; ``sizes``: M, N (output features), K; ``strides``: then eps; ``flags``: the
    fusion switches)."""
    m, n, k = sizes
    bn = block_n or SPLITK_BLOCK_N
    if bn < SPLITK_MIN_BLOCK_N or bn & (bn - 1):
        raise ValueError(
            f"block_n must be a power of 2 >= {SPLITK_MIN_BLOCK_N} in the split-K form, got {bn}"
        )
    bk, chunk, splits = splitk_tiles(k, block_k, split_k)
    x, weight = ptrs[0], ptrs[1]
    ws, cnt = splitk_workspace(x.device, weight.shape[0])
    norm_block = max(16, min(triton.next_power_of_2(k), 128 * num_warps))
    _skinny_splitk_kernel[(triton.cdiv(n, bn), splits)](
        *ptrs, ws, cnt, m, n, k, chunk, *strides, **flags,
        DOT=DOT, BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, NORM_BLOCK=norm_block, USE_PDL=pdl,
        num_warps=num_warps, **launch_options(pdl),
    )  # fmt: skip
