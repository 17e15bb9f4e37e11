"""A device-side verification step's tail as one CUDA graph: acceptance test, drafter context, next block.

After the target's verification forward (a ``DecodeGraphs`` replay), a decoupled DFlash step ran ~55 small
eager launches: the logits / hidden-state gathers, greedy sampling, the acceptance test, the drafter context
rows and the packing of the result (H100, session 29, ``torch.profiler``: 55 ``cudaLaunchKernel`` + 3 graph
launches per batch-1 step, the GPU idle between them while the host launched the next). With every sequence a
decode query in the decode graph's padded layout (sequence s owns rows ``s * q .. s * q + q - 1``) the tail
has a fixed shape per (q, batch size) and is captured here, reading the decode graph's static outputs in
place: the step becomes two graph replays, two staged input copies (one per graph) and the readback.

Same results as the eager device-side path (``SpecDecodeWorker._launch_on_device``): target tokens by argmax
(all-greedy steps only), drafts accepted iff equal to them (``accept_deterministic_drafts``; draft trees:
``accept_tree_drafts`` and the accepted nodes' K/V moves), the drafter's ``fused_tail`` for context and block. Vocabulary as vLLM's "full CUDA graph" mode for speculative decoding
(vllm/v1/worker/gpu_model_runner.py), where sampling and the drafter stay outside the target's graph.
"""

from __future__ import annotations

import numpy as np
import torch

from flexspec.engine.cuda_graphs import DecodeGraphs, capture_graphs
from flexspec.engine.graph_inputs import SMALL_BATCH, StagedInputs, write_table_rows
from flexspec.engine.model_input import ModelInput
from flexspec.spec.dflash_device import META_COLS
from flexspec.spec.tree import tree_parent_rows
from flexspec.spec.tree_device import accept_tree_drafts, tree_move_pairs
from flexspec.spec.verifier import accept_deterministic_drafts
from flexspec_kernels.argmax import argmax


class FusedVerifyGraphs:
    """The tail of a device-side verification step, per batch size, for one ``DecodeGraphs`` (query length q).

    Per step the host stages one int64 row per sequence (``stage_tail_rows``): the drafter's meta row
    (``plan_device_step``: ``META_COLS`` columns, then its block table in W = ``fused_table_width`` columns), then the
    sequence's q - 1 drafts (0-padded), and for a tree graph (``decode.tree``) their q - 1 parents
    (``flexspec.spec.tree.tree_parent_rows``); dummy sequences up to the graph's batch size are all 0 (context 0, cache
    not ready: nothing written, nothing drafted). A tree graph's tail verifies trees (``accept_tree_drafts``) and
    moves the accepted nodes' K/V to their positions' slots (``tree_move_pairs``, slots from the decode graph's
    staged slot mapping) before the drafter's tail.

    Args:
        decode: the target's decode graphs whose static outputs the tail reads (``decode.q`` rows per sequence).
        drafter: a DFlash-family drafter (``fused_tail``, ``fused_table_width``, ``capture_layers``).
        pool: a graph memory pool to share.
        capture: capture CUDA graphs (False: ``run`` executes the same tail eagerly; CPU tests).

    Raises:
        RuntimeError: from capture when the tail cannot be captured (the worker keeps the eager path).
    """

    def __init__(self, decode: DecodeGraphs, drafter, pool=None, capture: bool = True) -> None:
        self.decode = decode
        self.drafter = drafter
        self.q = decode.q
        self.tree = decode.tree
        self.batch_sizes = decode.batch_sizes
        # int64 columns per staged row: meta, drafts, (parents)
        self.meta_width = META_COLS + drafter.fused_table_width
        self.width = self.meta_width + (self.q - 1) * (2 if self.tree else 1)
        max_bs = self.batch_sizes[-1]
        self.stage = StagedInputs({"rows": max_bs * self.width}, decode.runner.device)
        self.stage.send()  # all 0: dummy rows
        self.table_rows: list[tuple[list[int] | None, int]] = []  # ``write_table_rows``' record of the tables
        self.outputs: dict[int, torch.Tensor] = {}  # bs -> packed [bs, q + 1 + D + 1] int64
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = pool
        for bs in self.batch_sizes:  # host-built constants (packed block masks) exist before capture
            drafter._block_masks(bs)
        if capture:
            self.graphs, self.outputs, self.pool = capture_graphs(self.batch_sizes, self._step, pool)

    def _step(self, bs: int) -> torch.Tensor:
        """What the graph of batch size ``bs`` runs: argmax of the verification logits, the acceptance test,
        the drafter's tail, packed as ``[tokens (q), accepted, drafts (D), keep]`` per sequence."""
        q = self.q
        rows = self.stage.on_device("rows")[: bs * self.width].view(bs, self.width)
        meta, drafts = rows[:, : self.meta_width], rows[:, self.meta_width : self.meta_width + q - 1]
        target = argmax(self.decode.logits[bs])  # [bs * q]
        starts = torch.arange(bs, device=rows.device) * q
        captured = self.decode.captured[bs]
        if not self.tree:
            tokens, accepted = accept_deterministic_drafts(
                target, starts, meta[:, 4], drafts
            )  # [bs, q], [bs]
            next_drafts, keep = self.drafter.fused_tail(meta, tokens, accepted, captured)
        else:
            parents = rows[:, self.meta_width + q - 1 :]
            tokens, accepted, path = accept_tree_drafts(target, starts, meta[:, 4], drafts, parents)
            slots = self.decode.slot_mapping[: bs * q].view(bs, q)
            self.decode.runner.move_kv(*tree_move_pairs(slots, path, accepted))
            next_drafts, keep = self.drafter.fused_tail(meta, tokens, accepted, captured, path=path)
        return torch.cat([tokens, accepted[:, None], next_drafts, keep[:, None]], 1)

    def can_run(self, inp: ModelInput) -> bool:
        """Whether ``inp``'s batch fits (the decode graph's ``can_run`` checks the rest)."""
        return len(inp.query_lens) <= self.batch_sizes[-1]

    def run(
        self, inp: ModelInput, bs: int, meta_rows: list[list[int]], tables: list[list[int]]
    ) -> torch.Tensor:
        """Stage ``plan_device_step``'s ``meta_rows`` [S, META_COLS] and drafter block ``tables`` (at most
        ``fused_table_width`` entries each: the drafter reserves at most max_model_len) and ``inp``'s drafts, then
        replay the tail of batch size ``bs`` (the one the decode graph just replayed). Returns the packed
        result's first S rows [S, q + 2 + D] (a static buffer: valid until the next ``run``)."""
        S = len(inp.query_lens)
        self.stage.wait_sent()
        host = self.stage.host("rows").reshape(-1, self.width)
        stage_tail_rows(host, self.table_rows, inp, meta_rows, tables, self.meta_width, bs)
        if self.tree:
            parents = tree_parent_rows(inp, self.q - 1)
            host[:S, self.meta_width + self.q - 1 :] = np.asarray(parents, dtype=np.int64).reshape(S, -1)
        self.stage.send()
        if self.graphs:
            self.graphs[bs].replay()
            out = self.outputs[bs]
        else:
            out = self._step(bs)
        return out[:S]


def stage_tail_rows(
    host: np.ndarray,
    table_rows: list[tuple[list[int] | None, int]],
    inp: ModelInput,
    meta_rows: list[list[int]],
    tables: list[list[int]],
    meta_width: int,
    bs: int,
) -> None:
    """Write a fused tail's per-sequence rows into ``host`` [>= bs, >= meta_width + q - 1] int64 (a staged buffer
    kept between steps): ``meta_rows`` [S][META_COLS] first, drafter block ``tables`` after them
    (``write_table_rows``, record ``table_rows``: new entries only), ``inp``'s drafts (every sequence a decode
    query ``[last token, drafts...]``) from column ``meta_width``, 0-padded; rows S .. bs-1 (dummy sequences)
    all 0. At batch 64 with ``fused_table_width`` 128, padding every table and the per-sequence draft copies
    cost ~0.5 ms per step on a 2-core CPU, ~80 us this way (``bench.host_staging``)."""
    S = len(inp.query_lens)
    host[:S, :META_COLS] = meta_rows
    write_table_rows(host[:, META_COLS:meta_width], table_rows, tables)
    drafts = host[:S, meta_width:]  # (a tree graph's parents columns too: written after this)
    drafts[:] = 0
    if S <= SMALL_BATCH:  # numpy's fixed costs exceed a loop's at small batch
        r = 0
        for s, (n, d) in enumerate(zip(inp.query_lens, inp.num_draft_tokens)):
            if d:
                drafts[s, :d] = inp.input_ids[r + n - d : r + n]
            r += n
    elif any(inp.num_draft_tokens):
        query_lens = np.asarray(inp.query_lens, dtype=np.int64)
        firsts = np.cumsum(query_lens) - query_lens
        col = np.arange(inp.num_tokens, dtype=np.int64) - np.repeat(
            firsts + query_lens - np.asarray(inp.num_draft_tokens, dtype=np.int64), query_lens
        )  # [T] a token's index among its sequence's drafts (< 0: not a draft)
        is_draft = col >= 0
        seq = np.repeat(np.arange(S, dtype=np.int64), query_lens)
        drafts[seq[is_draft], col[is_draft]] = np.asarray(inp.input_ids, dtype=np.int64)[is_draft]
    if bs > S:  # dummy sequences: all 0 (their table rows too)
        host[S:bs] = 0
        for row in range(S, min(bs, len(table_rows))):
            table_rows[row] = (None, 0)
