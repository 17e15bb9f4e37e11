"""Column / row parallel linear layers (Megatron-LM, arXiv 1909.08053; nano-vllm layout).

A column-parallel layer splits the output features over TP ranks (no communication); a row-parallel layer
splits the input features and all-reduces the partial outputs. Each parameter has a ``weight_loader`` that
copies this rank's slice of a full checkpoint tensor, so one model file runs at any TP size.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from flexspec.distributed import TPGroup, shard_range

# fp32 GEMMs on CPU (``linear``): "onednn" runs weights that are ``nn.Parameter``s through oneDNN with the
# weight reordered ("prepacked") once, "skinny" runs MKL as (W @ x^T)^T for SKINNY_CPU_ROWS rows, "f_linear"
# F.linear.
CPU_GEMM: Literal["onednn", "skinny", "f_linear"] = "onednn"
SKINNY_CPU_ROWS = (2, 32)  # rows of x for which the "skinny" form computes (W @ x^T)^T
ONEDNN_ROWS_HINT = 32  # the row count oneDNN's weight layout is chosen for (any count runs with it)
_HAS_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


# parameter -> (its version when packed, packed copy), by identity (tensors' == is elementwise)
_PREPACKED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _prepacked(weight: nn.Parameter) -> torch.Tensor:
    """oneDNN's reordered copy of ``weight`` [N, K] (an opaque mkldnn tensor), made at first use and kept
    while the parameter lives (outside it, so the module still pickles); made again when the parameter has
    changed in place since (its version counter moved; an inference-mode tensor has none and cannot change
    in place outside inference mode)."""
    version = -1 if weight.is_inference() else weight._version
    cached = _PREPACKED.get(weight)
    if cached is None or cached[0] != version:
        with torch.no_grad():
            cached = (version, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ONEDNN_ROWS_HINT))
        _PREPACKED[weight] = cached
    return cached[1]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x [..., K], weight [N, K], bias [N] -> [..., N].

    fp32 on CPU (``CPU_GEMM``): a weight that is an ``nn.Parameter`` (a model's layer) goes through oneDNN's
    GEMM with the weight prepacked once (``torch.ops.mkldnn._linear_pointwise``, the op torch.compile's CPU
    backend emits): on a 2-core AVX2 machine a decode or verification step's GEMMs take ~20% less time than
    the best MKL form at 8-64 rows, prefill runs 1.2-1.8x faster than through ``F.linear``, and a row's result
    does not depend on how many rows are in the batch. Not with autograd recording (oneDNN's op has no
    backward); without oneDNN, or for other weights, 2-32 rows run as ``(weight @ x^T)^T`` (MKL's faster
    kernel for that shape). Other dtypes and devices use ``F.linear``. Results differ from ``F.linear``'s only
    by fp32 summation order."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32:
        needs_grad = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
        grad = needs_grad and torch.is_grad_enabled()
        if CPU_GEMM == "onednn" and _HAS_ONEDNN and isinstance(weight, nn.Parameter) and not grad:
            return torch.ops.mkldnn._linear_pointwise(x, _prepacked(weight), bias, "none", [], "")
        lo, hi = SKINNY_CPU_ROWS
        if CPU_GEMM != "f_linear" and x.dim() == 2 and lo <= x.shape[0] <= hi:
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
