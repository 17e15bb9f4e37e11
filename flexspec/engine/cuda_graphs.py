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
        pool=None,  # a graph memory pool to share (``DecodeGraphs.pool`` of a larger capture)
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
        self.pool = pool
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
            pos.extend(
                inp.positions[r : r + n] + [min(last + 1 + i, self.max_position) for i in range(q - n)]
            )
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


class BatchGraphs:
    """A fixed-shape step function captured as one CUDA graph per batch size (drafters' forwards).

    ``fn(**inputs) -> tuple[Tensor, ...]`` must be free of host syncs and host-to-device copies; every input
    and output has the batch as its leading dimension. Inputs are declared as ``name -> (trailing shape,
    dtype, pad value)``; a trailing dimension of a 2-D input may be filled only partly at run time (block
    tables: columns past a row's context are never read). Rows past the real batch are padded with the pad
    value, so pads must describe a harmless dummy sequence (e.g. context length 0 or 1, slot -1).

    Args:
        fn: the step function.
        inputs: the input declaration (see above).
        batch_sizes: batch sizes to capture; ``run`` pads a batch up to the next one.
        device: the CUDA device.

    Raises:
        RuntimeError: from capture when ``fn`` syncs or copies from the host (callers fall back to eager).
    """

    def __init__(
        self,
        fn,
        inputs: dict[str, tuple[tuple[int, ...], torch.dtype, int]],
        batch_sizes: list[int],
        device: torch.device,
    ) -> None:
        self.fn = fn
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_bs = self.batch_sizes[-1]
        self.pads = {name: pad for name, (_, _, pad) in inputs.items()}
        self.static = {
            name: torch.full((self.max_bs, *shape), pad, dtype=dtype, device=device)
            for name, (shape, dtype, pad) in inputs.items()
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self._capture()

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for bs in reversed(self.batch_sizes):  # largest first so smaller graphs reuse its memory pool
            args = {name: buf[:bs] for name, buf in self.static.items()}
            for _ in range(2):  # warm up (Triton compile) outside the graph
                self.fn(**args)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = tuple(self.fn(**args))
            pool = pool or graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def can_run(self, batch: int, **inputs: torch.Tensor) -> bool:
        return batch <= self.max_bs and all(
            x.dim() == 1 or x.shape[1] <= self.static[name].shape[1] for name, x in inputs.items()
        )

    def run(self, batch: int, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Copy ``inputs`` (each [batch, ...] on the device) in, replay, return the outputs' first ``batch`` rows
        (views into static buffers: valid until the next ``run``)."""
        bs = next(b for b in self.batch_sizes if b >= batch)
        for name, x in inputs.items():
            buf = self.static[name]
            if x.dim() == 1:
                buf[:batch].copy_(x, non_blocking=True)
            else:
                buf[:batch, : x.shape[1]].copy_(x, non_blocking=True)
            if bs > batch:
                buf[batch:bs].fill_(self.pads[name])
        self.graphs[bs].replay()
        return tuple(o[:batch] for o in self.outputs[bs])
