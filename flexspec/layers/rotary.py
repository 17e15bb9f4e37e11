"""Rotary position embedding (Su et al., arXiv 2104.09864), neox (rotate-half) layout as in HF Llama."""

from __future__ import annotations

import math

import torch
from torch import nn

from flexspec.layers.fused import use_fused
from flexspec_kernels.rotary import rotary_embedding_triton


def _inv_freq(head_dim: int, theta: float, rope: dict | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    rope_type = (rope or {}).get("rope_type", "default")
    if rope_type in ("default", None):
        return inv
    if rope_type == "linear":
        return inv / float(rope["factor"])
    if rope_type == "llama3":  # Llama 3.1 frequency-dependent scaling
        factor = float(rope["factor"])
        low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old_len = float(rope["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, Hq, D] and k [T, Hkv, D] at integer ``positions`` [T]."""

    def __init__(self, head_dim: int, max_position: int, theta: float, rope: dict | None = None) -> None:
        super().__init__()
        inv = _inv_freq(head_dim, theta, rope)
        t = torch.arange(max_position, dtype=torch.float64)
        freqs = torch.outer(t, inv)  # [max_position, D/2]
        self.register_buffer("cos", freqs.cos().float(), persistent=False)
        self.register_buffer("sin", freqs.sin().float(), persistent=False)
        self._held: tuple | None = None  # (positions copy, cos table, cos rows, sin rows): see _rows

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64, q [T, Hq, D], k [T, Hkv, D] -> rotated (q, k), same shapes and dtype.

        Other leading shapes ([B, L, H, D] with positions [B, L]) take the torch path.
        """
        if self.fusable(positions, q, k):
            return rotary_embedding_triton(positions, q, k, self.cos, self.sin)
        cos, sin = self._rows(positions)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def _rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([..., 1, D] (cos, cos), [..., 1, D] (-sin, sin)) at ``positions``, the rotate-half layout. The last
        positions' rows are kept on CPU, where a step's layers ask for the same positions (matched by value; not
        on GPUs, where a CUDA graph capture must record the gather)."""
        held = self._held
        if held is not None and held[1] is self.cos and torch.equal(held[0], positions):
            return held[2], held[3]
        cos = self.cos[positions].unsqueeze(-2)  # [..., 1, D/2]
        sin = self.sin[positions].unsqueeze(-2)
        rows = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
        if positions.device.type == "cpu":
            self._held = (positions.clone(), self.cos, *rows)
        return rows

    def fusable(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Whether ``flexspec_kernels.rotary``'s Triton kernel serves these inputs (CUDA, no autograd, [T, H, D])."""
        half = q.shape[-1] // 2
        return (
            use_fused(q, k)  # first: on CPU this alone decides
            and q.dim() == 3
            and positions.dim() == 1
            and half & (half - 1) == 0
            and q.stride(-1) == 1
            and k.stride(-1) == 1
            and positions.dtype == torch.int64
        )

    def forward_and_store(
        self,
        positions: torch.Tensor,  # [T] int64
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64, < 0 = do not cache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE and the KV-cache write in one launch (only where :meth:`fusable`)."""
        return rotary_embedding_triton(positions, q, k, self.cos, self.sin, v, k_cache, v_cache, slot_mapping)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * (cos, cos) + rotate_half(x) * (-sin, sin) in fp32: (x1 cos - x2 sin, x2 cos + x1 sin), bit for bit."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat((x2, x1), dim=-1) * sin).to(x.dtype)
