"""CUDA graphs for decode steps (one new token per sequence), captured for a fixed set of batch sizes.

A decode step of a small model is bound by kernel-launch overhead, not the GPU; replaying a captured graph
launches the whole forward (all layers + LM head) at once. Batches are padded up to the nearest captured
size with dummy rows (slot -1: nothing written; context length 0: nothing read).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flexspec.engine.model_input import ModelInput
from flexspec.layers.attention import AttentionMetadata

if TYPE_CHECKING:
    from flexspec.engine.model_runner import ModelRunner


class DecodeGraphs:
    def __init__(self, runner: "ModelRunner", batch_sizes: list[int]) -> None:
        self.runner = runner
        dev = runner.device
        self.batch_sizes = sorted({b for b in batch_sizes if b <= runner.config.max_num_seqs})
        B = self.max_bs = self.batch_sizes[-1]
        self.max_blocks = runner.max_blocks_per_seq
        self.input_ids = torch.zeros(B, dtype=torch.int64, device=dev)  # [B]
        self.positions = torch.zeros(B, dtype=torch.int64, device=dev)  # [B]
        self.slot_mapping = torch.full((B,), -1, dtype=torch.int64, device=dev)  # [B]
        self.block_tables = torch.zeros(B, self.max_blocks, dtype=torch.int32, device=dev)  # [B, max_blocks]
        self.context_lens = torch.zeros(B, dtype=torch.int32, device=dev)  # [B]
        self.query_start_loc = torch.arange(B + 1, dtype=torch.int32, device=dev)  # [B+1]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # bs -> [bs, V] output buffer
        self.pool = None
        self._capture()

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            positions=self.positions[:bs],
            slot_mapping=self.slot_mapping[:bs],
            block_tables=self.block_tables[:bs],
            context_lens=self.context_lens[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            max_query_len=1,
        )

    @torch.inference_mode()
    def _capture(self) -> None:
        model = self.runner.model
        for bs in reversed(self.batch_sizes):  # largest first so smaller graphs reuse its memory pool
            meta = self._meta(bs)
            for _ in range(2):  # warm up (Triton autotune / compile) outside the graph
                model.compute_logits(model(self.input_ids[:bs], meta)[0])
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                hidden, _ = model(self.input_ids[:bs], meta)
                self.logits[bs] = model.compute_logits(hidden)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def can_run(self, inp: ModelInput) -> bool:
        return (
            inp.is_pure_decode
            and len(inp.query_lens) <= self.max_bs
            and all(len(b) <= self.max_blocks for b in inp.block_tables)
        )

    def run(self, inp: ModelInput) -> torch.Tensor:
        """Replay the graph for ``inp`` (pure decode); returns logits [S, V]."""
        S = len(inp.query_lens)
        bs = next(b for b in self.batch_sizes if b >= S)
        width = max(len(b) for b in inp.block_tables)
        tables = [b + [0] * (width - len(b)) for b in inp.block_tables]
        self.input_ids[:S].copy_(torch.tensor(inp.input_ids), non_blocking=True)
        self.positions[:S].copy_(torch.tensor(inp.positions), non_blocking=True)
        self.slot_mapping[:S].copy_(torch.tensor(inp.slot_mapping), non_blocking=True)
        self.context_lens[:S].copy_(torch.tensor(inp.context_lens, dtype=torch.int32), non_blocking=True)
        self.block_tables[:S, :width].copy_(torch.tensor(tables, dtype=torch.int32), non_blocking=True)
        if bs > S:  # dummy rows: write nothing, read nothing
            self.slot_mapping[S:bs].fill_(-1)
            self.context_lens[S:bs].fill_(0)
            self.positions[S:bs].fill_(0)
        self.graphs[bs].replay()
        return self.logits[bs][:S]
