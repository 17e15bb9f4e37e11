"""Column / row parallel linear layers (Megatron-LM, arXiv 1909.08053; nano-vllm layout).

A column-parallel layer splits the output features over TP ranks (no communication); a row-parallel layer
splits the input features and all-reduces the partial outputs. Each parameter has a ``weight_loader`` that
copies this rank's slice of a full checkpoint tensor, so one model file runs at any TP size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flexspec.distributed import TPGroup, shard_range

SKINNY_CPU_ROWS = (2, 32)  # rows of x for which ``linear`` computes (W @ x^T)^T on CPU


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x [M, K], weight [N, K] -> [M, N].

    fp32 on CPU with 2-32 rows (decode and verification batches) computes ``(weight @ x^T)^T`` instead, the
    same product that MKL runs as a different kernel: a CPU decode step of the default model is ~15% faster
    (``weight`` is streamed from memory once per step, at ~7 GB/s through ``F.linear``'s kernel on a 2-core dev
    machine). Other shapes, dtypes and devices use ``F.linear``. Results differ from ``F.linear``'s only by
    fp32 summation order."""
    lo, hi = SKINNY_CPU_ROWS
    if x.dim() == 2 and lo <= x.shape[0] <= hi and x.dtype == torch.float32 and x.device.type == "cpu":
        y = (weight @ x.t()).t().contiguous()
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        raise NotImplementedError  # each subclass defines how a full tensor maps to its shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"{name}: checkpoint shard has shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
        )
    dst.copy_(src)


class ReplicatedLinear(LinearBase):
    """Same full weight on every rank."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        _copy(param.data, loaded, "ReplicatedLinear")


class ColumnParallelLinear(LinearBase):
    """y[:, shard] = x @ W[shard].T; output features [out_start, out_end) live on this rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        self.out_start, self.out_end = shard_range(out_features, tp.rank, tp.size)
        super().__init__(in_features, self.out_end - self.out_start, bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        _copy(param.data, loaded[self.out_start : self.out_end], "ColumnParallelLinear")


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel outputs fused in one GEMM (e.g. MLP gate_proj + up_proj).

    ``shard_id`` is the index of the sub-matrix being loaded; each is split over TP independently.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, tp: TPGroup) -> None:
        self.ranges = [shard_range(n, tp.rank, tp.size) for n in output_sizes]
        self.local_sizes = [e - s for s, e in self.ranges]
        super().__init__(in_features, sum(self.local_sizes), bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if not isinstance(shard_id, int):
            raise ValueError("MergedColumnParallelLinear needs an integer shard_id")  # noqa: TRY004 (ModelLoadError)
        offset = sum(self.local_sizes[:shard_id])
        start, end = self.ranges[shard_id]
        _copy(param.data[offset : offset + end - start], loaded[start:end], "MergedColumnParallelLinear")


class QKVParallelLinear(LinearBase):
    """Fused q/k/v projection with GQA-aware head sharding.

    KV heads are split over ranks as evenly as possible (uneven splits allowed, e.g. 3 KV heads on TP=2);
    each rank keeps the query heads of its KV groups. When TP > num_kv_heads, each rank holds one replicated
    KV head and ``num_heads / tp`` query heads. Output layout on each rank: [q | k | v].
    """

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, tp: TPGroup
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        group = num_heads // num_kv_heads
        if tp.size <= num_kv_heads:
            kv_start, kv_end = shard_range(num_kv_heads, tp.rank, tp.size)
            q_start, q_end = kv_start * group, kv_end * group
        else:
            if tp.size % num_kv_heads or num_heads % tp.size:
                raise ValueError(
                    f"tensor_parallel_size {tp.size} must divide num_heads {num_heads} and be a multiple "
                    f"of num_kv_heads {num_kv_heads}"
                )
            per_rank = num_heads // tp.size
            q_start, q_end = tp.rank * per_rank, (tp.rank + 1) * per_rank
            kv_start = q_start // group
            kv_end = kv_start + 1
        self.head_dim = head_dim
        self.q_range = (q_start * head_dim, q_end * head_dim)
        self.kv_range = (kv_start * head_dim, kv_end * head_dim)
        self.num_local_heads = q_end - q_start
        self.num_local_kv_heads = kv_end - kv_start
        self.q_size = self.num_local_heads * head_dim
        self.kv_size = self.num_local_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if shard_id == "q":
            dst, (s, e) = param.data[: self.q_size], self.q_range
        elif shard_id == "k":
            dst, (s, e) = param.data[self.q_size : self.q_size + self.kv_size], self.kv_range
        elif shard_id == "v":
            dst, (s, e) = param.data[self.q_size + self.kv_size :], self.kv_range
        else:
            raise ValueError(f"QKVParallelLinear shard_id must be q/k/v, got {shard_id!r}")
        _copy(dst, loaded[s:e], f"QKVParallelLinear[{shard_id}]")


class RowParallelLinear(LinearBase):
    """y = all_reduce(x[:, shard] @ W[:, shard].T) + b; input features [in_start, in_end) on this rank.

    ``in_ranges`` overrides the even split (used for o_proj after uneven head sharding).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TPGroup,
        in_range: tuple[int, int] | None = None,
    ) -> None:
        self.in_start, self.in_end = in_range or shard_range(in_features, tp.rank, tp.size)
        super().__init__(self.in_end - self.in_start, out_features, bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if param.dim() == 1:  # bias: added once, after the reduction
            _copy(param.data, loaded, "RowParallelLinear.bias")
        else:
            _copy(param.data, loaded[:, self.in_start : self.in_end], "RowParallelLinear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight)
        y = self.tp.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
