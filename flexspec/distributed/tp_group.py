"""Tensor-parallel process group handle, passed explicitly to layers (no hidden globals)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def shard_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """Contiguous [start, end) of ``total`` items owned by ``rank`` when split as evenly as possible.

    The first ``total % size`` ranks get one extra item, so uneven splits (e.g. 3 KV heads over TP=2) work.
    """
    base, extra = divmod(total, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclass(frozen=True)
class TPGroup:
    """One tensor-parallel group: this process's ``rank`` of ``size``; ``group`` is None for TP=1."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group in place (no-op for TP=1)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate each rank's ``x[..., sizes[r]]`` along the last dim (uneven shards allowed)."""
        if self.size == 1:
            return x
        width = max(sizes)
        if x.shape[-1] < width:
            x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
        out = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(out, x.contiguous(), group=self.group)
        return torch.cat([o[..., :s] for o, s in zip(out, sizes)], dim=-1)

    def broadcast_object(self, obj: object) -> object:
        """Send a picklable object from rank 0 to every rank; returns it on all ranks."""
        if self.size == 1:
            return obj
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]
