"""A drafter's own paged KV cache: per-layer K/V tensors + per-sequence block tables.

Same layout as the target's cache (``[num_blocks, block_size, Hkv, D]`` per layer; token at position ``p`` of
a sequence lives in slot ``blocks[p // block_size] * block_size + p % block_size``), so
``flexspec_kernels.store_kv_cache`` and ``flexspec_kernels.paged_attention`` (through ``flexspec.layers.attention.Attention``)
serve both.

Sizing: ``memory_bytes`` is asked before the target's cache exists, so the cache is bounded by what any batch
can use (``max_num_seqs`` full-length sequences) and that bound is what the drafter reserves; ``allocate``
then takes the smaller of the bound and the target's block count (+ one sequence of slack for drafted
positions).
"""

from __future__ import annotations

from collections import deque

import torch

from flexspec.layers.attention import Attention, AttentionMetadata
from flexspec_kernels import pack_masks


class DraftKVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        max_tokens_per_seq: int,
        max_num_seqs: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.max_blocks_per_seq = -(-max_tokens_per_seq // block_size)
        self.max_num_blocks = max_num_seqs * self.max_blocks_per_seq + 1
        self.k: list[torch.Tensor] = []  # [num_layers] of [num_blocks, block_size, Hkv, D]
        self.v: list[torch.Tensor] = []
        self.tables: dict[int, list[int]] = {}  # seq id -> physical block ids
        self.free_blocks: deque[int] = deque()

    # ---- memory --------------------------------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        elems = 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim
        return elems * torch.finfo(self.dtype).bits // 8

    def reserved_bytes(self) -> int:
        """Upper bound of what ``allocate`` may take (what the drafter reports before allocation)."""
        return self.max_num_blocks * self.bytes_per_block()

    def allocate(self, num_target_blocks: int) -> int:
        num = min(self.max_num_blocks, num_target_blocks + self.max_blocks_per_seq)
        shape = (num, self.block_size, self.num_kv_heads, self.head_dim)
        self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.tables.clear()
        self.free_blocks = deque(range(num))
        return num

    def bind(self, attn_layers: list[Attention]) -> None:
        """Point each attention core at its layer's cache (store + paged read happen inside it)."""
        if len(attn_layers) != self.num_layers:
            raise ValueError(f"{len(attn_layers)} attention layers for a cache of {self.num_layers}")
        for a, k, v in zip(attn_layers, self.k, self.v):
            a.k_cache, a.v_cache = k, v

    # ---- sequences -----------------------------------------------------------------------------------------
    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.tables

    def reserve(self, seq_id: int, num_tokens: int, evictable: set[int] | None = None) -> bool:
        """Make positions ``0 .. num_tokens-1`` of ``seq_id`` addressable. When blocks run out, sequences in
        ``evictable`` (not in this step's batch) are dropped first. False (and the sequence freed) if still
        short.
        """
        table = self.tables.setdefault(seq_id, [])
        need = -(-num_tokens // self.block_size) - len(table)
        if need > len(self.free_blocks) and evictable:
            for sid in list(evictable):
                if sid != seq_id:
                    self.free(sid)
                if need <= len(self.free_blocks):
                    break
        if need > len(self.free_blocks):
            self.free(seq_id)
            return False
        for _ in range(max(0, need)):
            table.append(self.free_blocks.popleft())
        return True

    def slot(self, seq_id: int, pos: int) -> int:
        return self.tables[seq_id][pos // self.block_size] * self.block_size + pos % self.block_size

    def free(self, seq_id: int) -> None:
        table = self.tables.pop(seq_id, None)
        if table:
            self.free_blocks.extend(table)

    # ---- attention metadata --------------------------------------------------------------------------------
    def metadata(
        self,
        seq_ids: list[int],
        positions: list[list[int]],  # [S][n_s] absolute positions of each sequence's new tokens
        context_lens: list[int],  # [S] cached positions 0 .. ctx-1 every new token of the sequence sees
        store: bool,  # write the new tokens' K/V at their positions' slots
        masks: list[torch.Tensor] | None = None,  # S x [n_s, n_s] bool; None = causal over new tokens
    ) -> AttentionMetadata:
        dev = self.device
        flat_pos = [p for ps in positions for p in ps]
        slots = (
            [self.slot(s, p) for s, ps in zip(seq_ids, positions) for p in ps]
            if store
            else [-1] * len(flat_pos)
        )
        tables = [self.tables[s] for s in seq_ids]
        width = max((len(t) for t in tables), default=0) or 1
        qsl = [0]
        for ps in positions:
            qsl.append(qsl[-1] + len(ps))

        def t(x: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(x, dtype=dtype).to(dev, non_blocking=True)

        meta = AttentionMetadata(
            positions=t(flat_pos, torch.int64),
            slot_mapping=t(slots, torch.int64),
            block_tables=t([b + [0] * (width - len(b)) for b in tables], torch.int32),
            context_lens=t(context_lens, torch.int32),
            query_start_loc=t(qsl, torch.int32),
            max_query_len=max((len(ps) for ps in positions), default=1),
        )
        if masks is not None:
            meta.mask, meta.mask_start_loc = pack_masks([m.to(dev) for m in masks])
        return meta
