"""DFlash's device-side step (part of :class:`~flexspec.spec.dflash.DFlashDrafter`): the drafter's half of a
verification step that runs without a host sync between acceptance and drafting
(``SpecDecodeWorker._runs_on_device``), eager (``propose_on_device``) or captured with the worker's acceptance
test in one CUDA graph per query length and batch size (``fused_tail``, :mod:`flexspec.spec.fused_step`).

The host plans the step before the target forward (``plan_device_step``: drafter cache reservations, block
tables, positions left by plain steps); the device then writes the context K/V of each sequence's committed
rows (known only after acceptance, so rejected rows get slot -1) and runs the block
``[bonus, MASK x (B-1)]`` over the committed context.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from flexspec.spec.tree import cut_tree, is_chain
from flexspec_kernels.draft_tree import tree_top_paths

# Positions whose drafter context is written late: target KV slots (feature cache rows), positions, drafter slots.
_Held = tuple[list[int], list[int], list[int]]
# ``plan_device_step``'s meta row: context_len, query_len, first row, cache ready, num drafts, emits, room
# (max_len - context_len - query_len + num drafts - 2: the next tree's depth limit plus this step's accepted
# drafts, as ``SpecDecodeWorker._draft_inputs`` counts the room left).
META_COLS = 7
ROOM = 6  # the room column


def int64_rows(rows) -> torch.Tensor:
    """Equal-length lists of ints -> a CPU int64 tensor [len(rows), len(rows[0])], through numpy: ``torch.tensor``
    on nested lists costs ~0.2 us per element (11 ms for the 3 x 19k held positions of a batch of 64 entering
    speculation after a plain stretch, 2-core Xeon), numpy ~20 ns."""
    return torch.from_numpy(np.array(rows, dtype=np.int64))


def padded_meta(rows: list[list[int]], tables: list[list[int]]) -> np.ndarray:
    """``plan_device_step``'s meta rows [S, META_COLS] and drafter block tables as one int64 array
    [S, META_COLS + W], tables padded with 0 to the longest (W >= 1)."""
    width = max(map(len, tables), default=0) or 1
    out = np.zeros((len(rows), META_COLS + width), dtype=np.int64)
    out[:, :META_COLS] = rows
    for s, t in enumerate(tables):
        out[s, META_COLS : META_COLS + len(t)] = t
    return out


class DFlashDeviceStep:
    """The device-side step of ``DFlashDrafter`` (a mixin: the drafter's cache, graphs and model are its)."""

    # provided by DFlashDrafter
    greedy_drafts: bool
    device: torch.device
    runner: Any
    cache: Any
    model: Any
    _pending_from: dict[int, int]
    _feature_index: list[int]
    _graphs: Any
    _context_graphs: Any

    @property
    def proposes_on_device(self) -> bool:  # type: ignore[override]
        return self.greedy_drafts

    @property
    def device_trees(self) -> bool:  # type: ignore[override]
        return self.tree_topk > 1

    @torch.inference_mode()
    def propose_on_device(
        self,
        inp,
        tokens: torch.Tensor,
        accepted: torch.Tensor,
        captured: list[torch.Tensor],
        path: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``Drafter.propose_on_device``: the context K/V of each sequence's committed inputs (a decode query's
        rows 0 .. a, rows past a get slot -1; a prompt chunk's every row; after verifying trees, ``path`` [S, K]
        names the accepted nodes whose rows follow the root's) and of its positions left by plain steps
        (``defer_context``), then, for sequences that emit, the block ``[tokens[s, a], MASK x (B-1)]`` over
        their committed context (no block when the step proposes nothing); the same graphs as ``propose``, fed
        from device tensors. Sequences whose drafter cache cannot hold the step's positions write nothing, read
        no context and keep 0 drafts. With draft trees the drafts are ``_tree_drafts``' [S, 2N]."""
        dev, S = self.device, tokens.shape[0]
        rows, tables, held = self.plan_device_step(inp)
        held = self._flush_if_large(held, captured)
        meta = torch.from_numpy(padded_meta(rows, tables)).to(dev, non_blocking=True)  # [S, META_COLS + W]
        ctx, n, first_row, ready_t = meta[:, 0], meta[:, 1], meta[:, 2], meta[:, 3] > 0
        num_drafts, emits, table = meta[:, 4], meta[:, 5] > 0, meta[:, META_COLS:]
        committed = n - num_drafts + accepted  # [S] the query less its rejected drafts
        feats, pos, slots = self._context_rows(
            captured, inp.num_tokens, ctx, n, first_row, committed, ready_t, table, n - num_drafts, path
        )
        if held[0]:
            target_slots, held_pos, held_slots = int64_rows(held).to(dev, non_blocking=True)
            feats = torch.cat([self._held_features(target_slots), feats])
            pos, slots = torch.cat([held_pos, pos]), torch.cat([held_slots, slots])
        graphs = self._context_graphs
        if graphs is not None and graphs.can_run(feats.shape[0]):
            graphs.run(feats.shape[0], feats=feats, positions=pos, slots=slots)
        else:
            self.model.store_context(feats, pos, slots)
        if inp.num_speculative_tokens == 0:  # the step only verifies: context written, no block
            return accepted.new_zeros(S, 0), accepted.new_zeros(S)
        bonus = tokens.gather(1, accepted[:, None]).squeeze(1)  # [S]
        drafting = ready_t & emits  # a prompt chunk that does not end its prompt emits no token to draft from
        ctx_lens = torch.where(drafting, ctx + committed, 0).to(torch.int32)  # [S]
        tables_t = table.to(torch.int32)
        block = self._graphs
        if block is not None and block.can_run(S, tables=tables_t):
            out = block.run(S, bonus=bonus, ctx_lens=ctx_lens, tables=tables_t)
        elif self.tree_topk > 1:
            out = self._topk_block(bonus, ctx_lens, tables_t)
        else:
            out = self._greedy_block(bonus, ctx_lens, tables_t)
        drafts, keep = self._tree_drafts(*out, meta[:, ROOM] - accepted) if self.tree_topk > 1 else out
        return drafts, torch.where(drafting, keep, 0)

    def _tree_drafts(self, top: torch.Tensor, max_depth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Candidates [S, B-1, 2R] (``_topk_block``) and each sequence's room [S] int64 -> (its tree of
        ``num_speculative_tokens`` = N nodes at most ``max_depth`` deep as [S, 2N] int64: node tokens then
        parents, nodes worth verifying [S] int64: those whose probability product stays >=
        ``verification_threshold``, at least one unless no depth fits). The host cuts each tree to the step's
        node budget (``device_tree_drafts``). Sync-free."""
        drafts, parents, count = tree_top_paths(
            top, self.num_speculative_tokens, self.config.verification_threshold, max_depth
        )
        return torch.cat([drafts, parents], 1), count

    def device_tree_drafts(
        self, rows: list[list[int]], K: int, wanted: list[int]
    ) -> tuple[list[list[int]], list[list[int] | None]]:
        """A device-side step's next trees from its read-back ``rows`` (per emitting sequence ``[tokens (K + 1),
        accepted, node tokens (N), node parents (N), nodes worth verifying]``): each cut to the step's node budget
        (``_node_budget``) and to ``wanted[s]`` deep (the drafts the sequence may still emit, 0: none), as
        ``propose``'s trees are. Returns (drafts, parents; None for a chain)."""
        N = (len(rows[0]) - K - 3) // 2 if rows else 0
        budget = self._node_budget(sum(1 for w in wanted if w))
        drafts: list[list[int]] = []
        parents: list[list[int] | None] = []
        for w, row in zip(wanted, rows):
            n = min(budget, row[-1]) if w and N else 0
            ids, par = cut_tree(row[K + 2 : K + 2 + n], row[K + 2 + N : K + 2 + N + n], n, w)
            drafts.append(ids)
            parents.append(None if is_chain(par) else par)
        return drafts, parents

    def plan_device_step(self, inp) -> tuple[list[list[int]], list[list[int]], _Held]:
        """The host part of a device-side step: reserve each sequence's drafter cache for the step's committed
        positions and take its positions left by plain steps (``defer_context``). Returns per sequence the
        meta row (``META_COLS``: ``[context_len, query_len, first row, cache ready, num drafts, emits, room]``)
        and its drafter block table (the cache's own list, empty when not ready: ``padded_meta`` or
        ``FusedVerifyGraphs.run`` lay them out), and the held positions (not flushed)."""
        cache_tables, bs = self.cache.tables, self.cache.block_size
        evictable: set[int] | None = None  # sequences outside the step, computed when blocks run short
        rows: list[list[int]] = []
        tables: list[list[int]] = []
        r = 0
        for sid, ctx, n, d, e, max_len in zip(
            inp.seq_ids, inp.context_lens, inp.query_lens, inp.num_draft_tokens, inp.samples, inp.max_lens
        ):
            table = cache_tables.get(sid)
            # committed positions reach ctx + n - 1: most steps find them addressable already
            if table is None or len(table) * bs < ctx + n:
                if evictable is None and len(self.cache.free_blocks) * bs < ctx + n:
                    evictable = set(cache_tables) - set(inp.seq_ids)
                table = cache_tables[sid] if self.cache.reserve(sid, ctx + n, evictable) else None
            rows.append([ctx, n, r, int(table is not None), d, int(e), max_len - ctx - n + d - 2])
            tables.append(table if table is not None else [])
            r += n
        held: _Held = ([], [], [])  # positions left by plain steps: written with this step's context
        if self._pending_from:
            for sid, c, tbl in zip(inp.seq_ids, inp.context_lens, inp.block_tables):
                self._take_pending(sid, c, tbl, held)
        return rows, tables, held

    def write_held_context(self, held: _Held) -> None:
        """Write ``held`` (``plan_device_step``) on its own: context steps from the feature cache."""
        if held[0]:
            held = self._flush_if_large(held, [])
            self._write_context([], [], [], [], held)

    def fused_tail(
        self,
        meta: torch.Tensor,
        tokens: torch.Tensor,
        accepted: torch.Tensor,
        captured: list[torch.Tensor],
        path: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``propose_on_device``'s device part for a decode graph's padded layout, captured in one CUDA graph
        with the worker's acceptance test (``FusedVerifyGraphs``): S sequences of q rows each (rows
        ``s * q ..``), every one a decode query ``[last token, drafts...]`` that emits, no held positions.

        meta [S, META_COLS + W] int64 (``plan_device_step``'s rows; dummy sequences all 0), tokens [S, q] int64,
        accepted [S] int64, captured ``capture_layers`` outputs [S * q, H] each, path [S, q - 1] int64 (the
        accepted tree nodes, ``accept_tree_drafts``; None: chains) -> (drafts [S, D] int64, drafts worth
        verifying [S] int64; with draft trees ``_tree_drafts``' [S, 2N] and node counts). Sync-free."""
        S, q = tokens.shape
        ctx, n, ready_t = meta[:, 0], meta[:, 1], meta[:, 3] > 0
        num_drafts, emits, table = meta[:, 4], meta[:, 5] > 0, meta[:, META_COLS:]
        committed = n - num_drafts + accepted  # [S]
        rows = torch.full_like(n, q)  # each sequence owns q rows; those past `committed` are not written
        first_row = torch.arange(S, device=meta.device) * q
        feats, pos, slots = self._context_rows(
            captured, S * q, ctx, rows, first_row, committed, ready_t, table, n - num_drafts, path
        )
        self.model.store_context(feats, pos, slots)
        bonus = tokens.gather(1, accepted[:, None]).squeeze(1)  # [S]
        drafting = ready_t & emits
        ctx_lens = torch.where(drafting, ctx + committed, 0).to(torch.int32)
        if self.tree_topk > 1:
            top = self._topk_block(bonus, ctx_lens, table.to(torch.int32))
            drafts, keep = self._tree_drafts(*top, meta[:, ROOM] - accepted)
        else:
            drafts, keep = self._greedy_block(bonus, ctx_lens, table.to(torch.int32))
        return drafts, torch.where(drafting, keep, 0)

    @property
    def fused_table_width(self) -> int:
        """Drafter block-table columns of ``fused_tail``'s meta rows."""
        cfg = self.runner.config
        return -(-cfg.max_model_len // cfg.kv_block_size)

    def _context_rows(
        self, captured, num_tokens, ctx, n, first_row, committed, ready, table, node_start=None, path=None
    ):
        """Context rows of a step, one per input token (T = ``num_tokens``, in input order): sequence s's query
        of ``n[s]`` rows from ``first_row[s]`` at positions ``ctx[s] ..``, its first ``committed[s]`` rows
        written (slot -1 for the rest, and for sequences not ``ready``). After verifying draft trees, ``path``
        [S, K] (``accept_tree_drafts``) names the accepted nodes: the row at position root + 1 + k takes the
        features of node ``path[s, k]``'s row (node i is the query's row ``node_start[s] + i``). Returns
        feats [T, n*H], positions and slots [T]."""
        dev = ctx.device
        seqs = torch.arange(ctx.shape[0], device=dev)
        seq = torch.repeat_interleave(seqs, n, output_size=num_tokens)  # [T] each row's sequence
        j = torch.arange(num_tokens, device=dev) - first_row[seq]  # [T] row in its query
        pos = ctx[seq] + j
        bs = self.cache.block_size
        slots = table[seq, (pos // bs).clamp(max=table.shape[1] - 1)] * bs + pos % bs
        slots = torch.where((j < committed[seq]) & ready[seq], slots, -1)
        # rows written nowhere keep a position the rotary table holds: a tree graph's padded rows (q up to 63)
        # near max_model_len would reach past its max_model_len + B rows
        pos = torch.where(slots >= 0, pos, 0)
        feats = torch.cat([captured[i][:num_tokens] for i in self._feature_index], -1)
        if path is not None and path.shape[1]:
            node = j - node_start[seq]  # [T] the row's node index (< 0: the root or a committed input)
            moved = first_row[seq] + node_start[seq] + path[seq, node.clamp(0, path.shape[1] - 1)]
            feats = feats.index_select(0, torch.where(node >= 0, moved, first_row[seq] + j))
        return feats, pos, slots
