"""Gated MLP activation over a fused ``[gate | up]`` tensor in one launch.

``[..., 2d] -> [..., d]``: ``act(gate) * up`` with ``act`` = SiLU (SwiGLU, Shazeer arXiv 2002.05202) or
tanh-approximated GELU (GeGLU, Gemma). Rounding follows the unfused torch code (``act(gate)`` is
rounded to the input dtype before the product) so fp32 results agree to the last ulp or two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._dispatch import Backend, use_triton

ACTIVATIONS = ("silu", "gelu_tanh")


@triton.jit
def act_fn(g, ACT: tl.constexpr):
    """fp32 ``g`` -> SiLU(g) (ACT 0) or tanh-approximated GELU(g) (ACT 1); shared with ``flexspec_kernels.skinny_linear``."""
    if ACT == 0:
        return g / (1.0 + tl.exp(-g))
    inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    # tanh(x) = 1 - 2 / (exp(2x) + 1): portable (no libdevice), saturates cleanly at +-1.
    return 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))


@triton.jit
def _act_and_mul_kernel(
    x_ptr,  # [N, 2d]
    out_ptr,  # [N, d]
    x_stride,
    out_stride,
    d,
    ACT: tl.constexpr,  # 0 = silu, 1 = gelu_tanh
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_stride + d + cols, mask=mask, other=0.0)
    a = act_fn(gate.to(tl.float32), ACT).to(gate.dtype).to(tl.float32)
    y = a * up.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _check_args(x: torch.Tensor, activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x must be [..., 2d] with an even last dimension, got {tuple(x.shape)}")


def act_and_mul_ref(x: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Plain-torch reference (and CPU path) of :func:`act_and_mul`."""
    _check_args(x, activation)
    gate, up = x.chunk(2, dim=-1)
    a = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return a * up


def act_and_mul_triton(x: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Triton launcher of :func:`act_and_mul`; the output is a new contiguous tensor."""
    _check_args(x, activation)
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(d))
    if x2.shape[0]:
        _act_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out, x2.stride(0), out.stride(0), d,
            ACT=ACTIVATIONS.index(activation), BLOCK=block, num_warps=4,
        )  # fmt: skip
    return out.view(*x.shape[:-1], d)


def act_and_mul(x: torch.Tensor, activation: str = "silu", backend: Backend = "auto") -> torch.Tensor:
    """``act(x[..., :d]) * x[..., d:]`` for ``x`` [..., 2d] -> [..., d].

    Not differentiable on the Triton path. ``backend="auto"`` runs Triton on CUDA tensors and the torch
    reference otherwise.
    """
    if use_triton(backend, x):
        return act_and_mul_triton(x, activation)
    return act_and_mul_ref(x, activation)
