"""A drafter's own paged KV cache: per-layer K/V tensors + per-sequence block tables.

Same layout as the target's cache (``[num_blocks, block_size, Hkv, D]`` per layer; token at position ``p`` of
a sequence lives in slot ``blocks[p // block_size] * block_size + p % block_size``), so
``kernels.store_kv_cache`` and ``kernels.paged_attention`` (through ``flexspec.layers.attention.Attention``)
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
from kernels import pack_masks


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


class ContextBacklog:
    """Target features of committed positions whose drafter context K/V is not written yet.

    DFlash's plain decoding steps would otherwise run the drafter's context projection (feature fc + norm +
    K/V of every drafter layer, ~15 small kernels) for one token per sequence every step, ~5-8% of a batch-1
    step on the H200, although most of that context is only read when the sequence is next drafted for (it may
    never be). Instead each plain step copies its rows' features here (one scatter), and the projection runs
    once over all held positions of a sequence when it is drafted for, when its backlog is full, or when the
    step writes context anyway (a prefill chunk): same K/V, written later and in larger batches.

    A ring of ``size`` positions per sequence: position p of the sequence with ring row r is row
    ``r * size + p % size`` of ``feats`` [max_num_seqs * size, feat_dim]. ``pending[sid] = (start, end)``:
    positions start .. end - 1 are held (end - start <= size). ``size`` 0 disables it (nothing is held).
    """

    def __init__(self, size: int, max_num_seqs: int, feat_dim: int, dtype: torch.dtype, device) -> None:
        self.size = size
        self.shape = (max_num_seqs * size, feat_dim)
        self.dtype = dtype
        self.device = device
        self.feats: torch.Tensor | None = None
        self.free_rows: list[int] = list(range(max_num_seqs - 1, -1, -1))
        self.row_of: dict[int, int] = {}  # seq id -> ring row
        self.pending: dict[int, tuple[int, int]] = {}  # seq id -> held positions [start, end)

    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * torch.finfo(self.dtype).bits // 8

    def allocate(self) -> None:
        if self.size:
            self.feats = torch.zeros(self.shape, dtype=self.dtype, device=self.device)

    def can_hold(self, seq_id: int, start: int, num: int) -> bool:
        """Whether positions ``start .. start + num - 1`` extend ``seq_id``'s held run within the ring."""
        if self.feats is None or (seq_id not in self.row_of and not self.free_rows):
            return False
        first, end = self.pending.get(seq_id, (start, start))
        return end == start and start + num - first <= self.size

    def hold(self, seq_id: int, start: int, num: int) -> list[int]:
        """Hold positions ``start .. start + num - 1`` (``can_hold``); returns their rows in ``feats``."""
        row = self.row_of.get(seq_id)
        if row is None:
            row = self.row_of[seq_id] = self.free_rows.pop()
        first, _ = self.pending.get(seq_id, (start, start))
        self.pending[seq_id] = (first, start + num)
        return [row * self.size + p % self.size for p in range(start, start + num)]

    def take(self, seq_id: int, before: int | None = None) -> tuple[list[int], list[int]]:
        """Release ``seq_id``'s held positions (those < ``before`` only: later ones are being recomputed);
        returns (positions, rows in ``feats``) to project now."""
        first, end = self.pending.pop(seq_id, (0, 0))
        if before is not None:
            end = min(end, before)
        if end <= first:
            return [], []
        row = self.row_of[seq_id]
        positions = list(range(first, end))
        return positions, [row * self.size + p % self.size for p in positions]

    def drop(self, seq_id: int) -> None:
        self.pending.pop(seq_id, None)
        row = self.row_of.pop(seq_id, None)
        if row is not None:
            self.free_rows.append(row)
