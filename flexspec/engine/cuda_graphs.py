"""CUDA graphs for decode and speculative-verification steps, captured for a fixed set of batch sizes.

A decode step of a small model is bound by kernel-launch overhead, not the GPU; replaying a captured graph
launches the whole forward (all layers + LM head) at once. One ``DecodeGraphs`` serves steps where every
sequence has at most ``query_len`` new tokens (1 for plain decoding, 1 + K when verifying K drafts): each
sequence gets ``query_len`` rows, shorter ones are padded with dummy tokens (slot -1: nothing written; they
come after the real tokens, so causal attention keeps real rows exact), and batches are padded up to the
nearest captured size with dummy sequences (context length 0: nothing read).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flexspec.engine.model_input import ModelInput
from flexspec.layers.attention import AttentionMetadata

if TYPE_CHECKING:
    from flexspec.engine.model_runner import ModelRunner


class DecodeGraphs:
    def __init__(
        self,
        runner: ModelRunner,
        batch_sizes: list[int],
        query_len: int = 1,
        capture_layers: tuple[int, ...] = (),
    ) -> None:
        self.runner = runner
        self.q = query_len
        self.capture_layers = tuple(capture_layers)
        dev = runner.device
        self.batch_sizes = sorted({b for b in batch_sizes if b <= runner.config.max_num_seqs})
        B = self.max_bs = self.batch_sizes[-1]
        N = B * query_len
        self.max_blocks = runner.max_blocks_per_seq
        self.max_position = runner.spec.max_position_embeddings - 1
        self.input_ids = torch.zeros(N, dtype=torch.int64, device=dev)  # [B*q]
        self.positions = torch.zeros(N, dtype=torch.int64, device=dev)  # [B*q]
        self.slot_mapping = torch.full((N,), -1, dtype=torch.int64, device=dev)  # [B*q]
        self.block_tables = torch.zeros(B, self.max_blocks, dtype=torch.int32, device=dev)  # [B, max_blocks]
        self.context_lens = torch.zeros(B, dtype=torch.int32, device=dev)  # [B]
        self.query_start_loc = torch.arange(0, (B + 1) * query_len, query_len, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # bs -> [bs*q, V]
        self.captured: dict[int, list[torch.Tensor]] = {}  # bs -> [bs*q, H] per capture layer
        self.pool = None
        self._capture()

    def _meta(self, bs: int) -> AttentionMetadata:
        n = bs * self.q
        return AttentionMetadata(
            positions=self.positions[:n],
            slot_mapping=self.slot_mapping[:n],
            block_tables=self.block_tables[:bs],
            context_lens=self.context_lens[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            max_query_len=self.q,
        )

    @torch.inference_mode()
    def _capture(self) -> None:
        model = self.runner.model
        for bs in reversed(self.batch_sizes):  # largest first so smaller graphs reuse its memory pool
            n = bs * self.q
            meta = self._meta(bs)
            for _ in range(2):  # warm up (Triton compile) outside the graph
                h, _ = model(self.input_ids[:n], meta, capture_layers=self.capture_layers)
                model.compute_logits(h)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                hidden, captured = model(self.input_ids[:n], meta, capture_layers=self.capture_layers)
                self.logits[bs] = model.compute_logits(hidden)
                self.captured[bs] = captured
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def can_run(self, inp: ModelInput) -> bool:
        return (
            len(inp.query_lens) <= self.max_bs
            and all(1 <= q <= self.q for q in inp.query_lens)
            and tuple(inp.capture_layers) == self.capture_layers
            and all(len(b) <= self.max_blocks for b in inp.block_tables)
        )

    def run(self, inp: ModelInput) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Replay the graph for ``inp``; returns (logits [N, V] for inp.logits_indices, captured [T, H] each)."""
        S, q = len(inp.query_lens), self.q
        bs = next(b for b in self.batch_sizes if b >= S)
        width = max(len(b) for b in inp.block_tables)
        tables = [b + [0] * (width - len(b)) for b in inp.block_tables]
        ids, pos, slots, rows = [], [], [], []  # padded layout; rows[r] = padded row of inp token r
        r = 0
        for s, n in enumerate(inp.query_lens):
            ids.extend(inp.input_ids[r : r + n] + [0] * (q - n))
            last = inp.positions[r + n - 1]
            pos.extend(inp.positions[r : r + n] + [min(last + 1 + i, self.max_position) for i in range(q - n)])
            slots.extend(inp.slot_mapping[r : r + n] + [-1] * (q - n))
            rows.extend(range(s * q, s * q + n))
            r += n
        m = S * q
        self.input_ids[:m].copy_(torch.tensor(ids), non_blocking=True)
        self.positions[:m].copy_(torch.tensor(pos), non_blocking=True)
        self.slot_mapping[:m].copy_(torch.tensor(slots), non_blocking=True)
        self.context_lens[:S].copy_(torch.tensor(inp.context_lens, dtype=torch.int32), non_blocking=True)
        self.block_tables[:S, :width].copy_(torch.tensor(tables, dtype=torch.int32), non_blocking=True)
        if bs > S:  # dummy sequences: write nothing, read nothing
            self.slot_mapping[m : bs * q].fill_(-1)
            self.context_lens[S:bs].fill_(0)
            self.positions[m : bs * q].fill_(0)
        self.graphs[bs].replay()
        dev = self.runner.device
        if q == 1 and len(inp.logits_indices) == S:
            logits = self.logits[bs][:S]
        else:
            logits = self.logits[bs][torch.tensor([rows[i] for i in inp.logits_indices], device=dev)]
        captured: list[torch.Tensor] = []
        if self.capture_layers:
            idx = torch.tensor(rows, device=dev)
            captured = [c[idx] for c in self.captured[bs]]
        return logits, captured
