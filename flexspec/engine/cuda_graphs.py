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

import numpy as np
import torch

from flexspec.engine.graph_inputs import StagedInputs, gather_prev_tokens, stage_decode_inputs
from flexspec.engine.model_input import ModelInput
from flexspec.layers.attention import AttentionMetadata
from flexspec.spec.tree import tree_mask_bits

if TYPE_CHECKING:
    from flexspec.engine.model_runner import ModelRunner


@torch.inference_mode()
def capture_graphs(sizes: list[int], step, pool=None) -> tuple[dict, dict, object]:
    """Capture ``step(n)`` as one CUDA graph per size, largest first so that smaller graphs reuse its memory
    pool; each is run twice outside the graph first (Triton compiles). Returns (size -> graph, size -> what
    ``step`` returned during capture: the graph's static outputs, the pool)."""
    graphs, outputs = {}, {}
    for n in sorted(sizes, reverse=True):
        for _ in range(2):
            step(n)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs[n] = step(n)
        pool = pool or graph.pool()
        graphs[n] = graph
    torch.cuda.synchronize()
    return graphs, outputs, pool


class DecodeGraphs:
    def __init__(
        self,
        runner: ModelRunner,
        batch_sizes: list[int],
        query_len: int = 1,
        capture_layers: tuple[int, ...] = (),
        pool=None,  # a graph memory pool to share (``DecodeGraphs.pool`` of a larger capture)
        capture: bool = True,  # False: ``run`` executes the same padded step eagerly (CPU tests of the layout)
        tree: bool = False,  # draft trees: every row's attention mask is an input (``tree_mask_bits``)
    ) -> None:
        self.runner = runner
        self.q = query_len
        self.tree = tree
        if tree and query_len > 63:
            raise ValueError(f"tree graphs stage a 63-bit mask per row, not {query_len} rows")
        self.capture_layers = tuple(capture_layers)
        dev = runner.device
        self.batch_sizes = sorted({b for b in batch_sizes if b <= runner.config.max_num_seqs})
        B = self.max_bs = self.batch_sizes[-1]
        N = B * query_len
        self.max_blocks = runner.max_blocks_per_seq
        self.max_position = runner.spec.max_position_embeddings - 1
        # All per-step inputs travel in one copy; ids, positions and slots are read in place (int64), context
        # lengths and block tables are cast to int32 by the graph itself.
        self.stage = StagedInputs(
            {
                "input_ids": N,
                "positions": N,
                "slot_mapping": N,
                "context_lens": B,
                "block_tables": B * self.max_blocks,
                "logits_rows": N,  # padded row of each requested logits row
                "token_rows": N,  # padded row of each real token (captured hidden states)
                "prev_rows": B,  # async scheduling: row of the previous step's sampled ids per sequence
                **({"mask_bits": N} if tree else {}),  # per row: bit j = sees row j of its sequence
            },
            dev,
        )
        if tree:  # rows default to causal (chains, pads, dummy sequences); a step rewrites its trees' rows
            self._causal_bits = np.tile(np.asarray(tree_mask_bits([], query_len), dtype=np.int64), B)
            self._bit_index = torch.arange(query_len, dtype=torch.int64, device=dev)
            qq = query_len * query_len
            self._mask_start_loc = torch.arange(0, (B + 1) * qq, qq, dtype=torch.int64, device=dev)
        self.input_ids = self.stage.on_device("input_ids")  # [B*q]
        self.positions = self.stage.on_device("positions")  # [B*q]
        self.slot_mapping = self.stage.on_device("slot_mapping")  # [B*q]
        self._context_lens64 = self.stage.on_device("context_lens")  # [B]
        self._block_tables64 = self.stage.on_device("block_tables").view(B, self.max_blocks)
        self.stage.host("slot_mapping")[:] = -1
        self.stage.send()
        self.block_tables = torch.zeros(B, self.max_blocks, dtype=torch.int32, device=dev)  # [B, max_blocks]
        self.context_lens = torch.zeros(B, dtype=torch.int32, device=dev)  # [B]
        self.query_start_loc = torch.arange(0, (B + 1) * query_len, query_len, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # bs -> [bs*q, V]
        self.captured: dict[int, list[torch.Tensor]] = {}  # bs -> [bs*q, H] per capture layer
        self.pool = pool
        if capture:
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

    def _step(self, bs: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """What the graph of batch size ``bs`` runs: cast the staged int64 metadata, forward, LM head."""
        self.context_lens[:bs].copy_(self._context_lens64[:bs])
        self.block_tables[:bs].copy_(self._block_tables64[:bs])
        model = self.runner.model
        meta = self._meta(bs)
        if self.tree:  # [bs*q] row bits -> the packed [bs*q*q] bool masks of the bs sequences
            bits = self.stage.on_device("mask_bits")[: bs * self.q]
            meta.mask = ((bits[:, None] >> self._bit_index) & 1).bool().view(-1)
            meta.mask_start_loc = self._mask_start_loc[: bs + 1]
        hidden, captured = model(self.input_ids[: bs * self.q], meta, capture_layers=self.capture_layers)
        return model.compute_logits(hidden, upcast=False), captured

    def _capture(self) -> None:
        self.graphs, outputs, self.pool = capture_graphs(self.batch_sizes, self._step, self.pool)
        for bs, (logits, captured) in outputs.items():
            self.logits[bs], self.captured[bs] = logits, captured

    def can_run(self, inp: ModelInput) -> bool:
        return (  # cheap checks first: the runner tries its graphs in turn on every step
            len(inp.query_lens) <= self.max_bs
            and tuple(inp.capture_layers) == self.capture_layers
            and (inp.draft_parents is None or self.tree)
            and (inp.prev_token_rows is None or self.q == 1)
            and all(1 <= q <= self.q for q in inp.query_lens)
            and all(len(b) <= self.max_blocks for b in inp.block_tables)
        )

    def run(
        self, inp: ModelInput, prev_tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Replay the graph for ``inp``; returns (logits [N, V] for inp.logits_indices, captured [T, H] each).

        With ``inp.prev_token_rows`` (async scheduling, q = 1) the input ids are gathered on the device from
        ``prev_tokens`` ([N'] int64, the previous step's sampled ids) after the staged copy; rows -1 (a
        sequence's 1-token prompt chunk, its id on the host) keep the staged id."""
        bs, direct = self.replay(inp, prev_tokens)
        S = len(inp.query_lens)
        if direct:
            logits = self.logits[bs][:S]
        else:
            logits = self.logits[bs][self.stage.on_device("logits_rows")[: len(inp.logits_indices)]]
        captured: list[torch.Tensor] = []
        if self.capture_layers and inp.keep_captured:
            if self.q == 1:
                captured = [c[:S].clone() for c in self.captured[bs]]
            else:
                idx = self.stage.on_device("token_rows")[: inp.num_tokens]
                captured = [c[idx] for c in self.captured[bs]]
        return logits, captured

    def replay(self, inp: ModelInput, prev_tokens: torch.Tensor | None = None) -> tuple[int, bool]:
        """Stage ``inp`` and replay (``run`` without reading the outputs): the results are in the padded layout
        of ``stage_decode_inputs`` (sequence s owns rows ``s * q ..``), ``logits[bs]`` [bs*q, V] and
        ``captured[bs]`` [bs*q, H] each, valid until the next replay. Returns (the graph's batch size bs,
        whether the logits rows are the first S rows)."""
        self.stage.wait_sent()
        bs, direct = stage_decode_inputs(
            self.stage, inp, self.q, self.batch_sizes, self.max_blocks, self.max_position
        )
        S = len(inp.query_lens)
        if inp.prev_token_rows is not None:
            self.stage.host("prev_rows")[:S] = inp.prev_token_rows
        if self.tree:
            self._stage_mask_bits(inp, bs)
        self.stage.send()
        rows = inp.prev_token_rows
        if rows is not None:
            if -1 in rows:  # 1-token prompt chunks next to decode rows: their ids stay the staged ones
                gather_prev_tokens(self.input_ids[:S], self.stage.on_device("prev_rows")[:S], prev_tokens)
            else:
                torch.index_select(
                    prev_tokens, 0, self.stage.on_device("prev_rows")[:S], out=self.input_ids[:S]
                )
        if self.graphs:
            self.graphs[bs].replay()
        else:  # not captured: the same padded step, eagerly, into the same (per batch size) outputs
            logits, captured = self._step(bs)
            if bs in self.logits:
                self.logits[bs].copy_(logits)
                for buf, c in zip(self.captured[bs], captured):
                    buf.copy_(c)
            else:
                self.logits[bs], self.captured[bs] = logits, captured
        return bs, direct

    def _stage_mask_bits(self, inp: ModelInput, bs: int) -> None:
        """Row masks of a tree graph's step: causal everywhere, then each draft tree's rows."""
        q = self.q
        bits = self.stage.host("mask_bits")
        bits[: bs * q] = self._causal_bits[: bs * q]
        if inp.draft_parents is None:
            return
        for s, (tree, n, d) in enumerate(zip(inp.draft_parents, inp.query_lens, inp.num_draft_tokens)):
            if tree is not None:
                bits[s * q : s * q + n] = tree_mask_bits(tree, n - d)


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

    def _capture(self) -> None:
        def step(bs: int) -> tuple[torch.Tensor, ...]:
            return tuple(self.fn(**{name: buf[:bs] for name, buf in self.static.items()}))

        self.graphs, self.outputs, _ = capture_graphs(self.batch_sizes, step)

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


def stage_mixed_inputs(
    stage: StagedInputs, inp: ModelInput, num_tokens: int, num_seqs: int, max_blocks: int
) -> None:
    """Write ``inp`` into ``stage``'s host regions in a ``MixedGraphs`` layout of ``num_tokens`` rows and
    ``num_seqs`` sequences: the real tokens first, in the input's order; the ``num_tokens - T`` pad tokens form
    one dummy sequence after the real ones (context 0, slot -1: nothing read from the cache, nothing written;
    causal attention keeps them away from real rows); the remaining sequences are empty (query length 0).

    Regions written: input_ids, positions, slot_mapping [num_tokens]; context_lens [num_seqs]; query_start_loc
    [num_seqs + 1]; block_tables rows [S]; logits_rows [N].
    """
    T, S = inp.num_tokens, len(inp.query_lens)
    ids, pos, slots = stage.host("input_ids"), stage.host("positions"), stage.host("slot_mapping")
    ids[:T], pos[:T], slots[:T] = inp.input_ids, inp.positions, inp.slot_mapping
    ids[T:num_tokens], pos[T:num_tokens], slots[T:num_tokens] = 0, 0, -1
    qsl = stage.host("query_start_loc")
    qsl[0] = 0
    qsl[1 : S + 1] = np.cumsum(inp.query_lens)
    qsl[S + 1 :] = num_tokens  # the dummy sequence ends at num_tokens; the ones after it are empty
    ctx = stage.host("context_lens")
    ctx[:S] = inp.context_lens
    ctx[S:num_seqs] = 0
    tables = stage.host("block_tables").reshape(-1, max_blocks)
    for s, b in enumerate(inp.block_tables):  # columns past a row's context are never read
        tables[s, : len(b)] = b
    stage.host("logits_rows")[: len(inp.logits_indices)] = inp.logits_indices


class MixedGraphs:
    """CUDA graphs of the model body for steps of any shape: prefill, chunked prefill, and prefill mixed with
    decode or verification queries, captured for a fixed set of token counts.

    Such a step run eagerly launches every layer's kernels from Python (~560 launches for a 30-layer model:
    ~20 ms of host time for ~2 ms of GPU work on the H200, bench/results/h200-2026-12-01-s8/profile); with
    request turnover each arriving request costs one. A step of T tokens and S sequences replays the graph of
    the smallest captured token count ``>= T`` (layout: ``stage_mixed_inputs``). The attention kernel's grid
    depends only on the token and sequence counts, and its tile sizes are those of the longest possible query
    (``max_query_len`` = the token count), so one graph serves every split of its tokens into sequences. The
    LM head runs eagerly on the rows that need logits (two launches; no [T, V] buffer per graph). Known cost:
    with prefill-sized tiles a 1-token decode query fills ``Hq / Hkv`` of a tile's ``BLOCK_M`` rows (its K/V
    reads, the bound, are the same as with decode tiles).

    With ``capture=False`` nothing is captured and ``run`` executes the same padded step eagerly (the layout's
    CPU tests; any device).

    Vocabulary as in vLLM's piecewise / full CUDA graphs (vllm/v1/worker/gpu_model_runner.py,
    ``cudagraph_capture_sizes`` in tokens); unlike vLLM's piecewise mode, attention is inside the graph.

    Args:
        runner: the model runner (its model, KV cache and limits).
        num_tokens: token counts to capture (each ``<= max_num_batched_tokens``).
        capture_layers: target layers whose outputs the step returns (a drafter's inputs).
        pool: a graph memory pool to share.
        capture: capture CUDA graphs (False: run padded steps eagerly).

    Raises:
        RuntimeError: from capture when the forward cannot be captured (callers run eagerly).
    """

    def __init__(
        self,
        runner: ModelRunner,
        num_tokens: list[int],
        capture_layers: tuple[int, ...] = (),
        pool=None,
        capture: bool = True,
    ) -> None:
        self.runner = runner
        self.capture_layers = tuple(capture_layers)
        self.sizes = sorted(set(num_tokens))
        T = self.max_tokens = self.sizes[-1]
        S = self.num_seqs = runner.config.max_num_seqs + 1  # + the dummy sequence of pad tokens
        self.max_blocks = runner.max_blocks_per_seq
        dev = runner.device
        self.stage = StagedInputs(
            {
                "input_ids": T,
                "positions": T,
                "slot_mapping": T,
                "context_lens": S,
                "query_start_loc": S + 1,
                "block_tables": S * self.max_blocks,
                "logits_rows": T,  # row of each requested logits row (real rows keep their index)
                "prev_rows": T,  # async scheduling: ModelInput.prev_token_rows
            },
            dev,
        )
        self.stage.host("slot_mapping")[:] = -1
        self.stage.send()
        self.block_tables = torch.zeros(S, self.max_blocks, dtype=torch.int32, device=dev)  # [S, max_blocks]
        self.context_lens = torch.zeros(S, dtype=torch.int32, device=dev)  # [S]
        self.query_start_loc = torch.zeros(S + 1, dtype=torch.int32, device=dev)  # [S + 1]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Outputs of every graph, written at the end of its step (one set for all token counts).
        H, dtype = runner.spec.hidden_size, runner.dtype
        self.hidden = torch.zeros(T, H, dtype=dtype, device=dev)  # [T, H]
        self.captured = [torch.zeros(T, H, dtype=dtype, device=dev) for _ in self.capture_layers]  # [T, H]
        self.pool = pool
        if capture:
            self._capture()

    def _step(self, n: int) -> None:
        """What the graph of ``n`` tokens runs: cast the staged int64 metadata, the model body, its outputs into
        ``hidden`` / ``captured`` (rows ``:n``)."""
        st = self.stage
        self.context_lens.copy_(st.on_device("context_lens"))
        self.query_start_loc.copy_(st.on_device("query_start_loc"))
        self.block_tables.copy_(st.on_device("block_tables").view(self.num_seqs, self.max_blocks))
        meta = AttentionMetadata(
            positions=st.on_device("positions")[:n],
            slot_mapping=st.on_device("slot_mapping")[:n],
            block_tables=self.block_tables,
            context_lens=self.context_lens,
            query_start_loc=self.query_start_loc,
            max_query_len=n,
        )
        hidden, captured = self.runner.model(
            st.on_device("input_ids")[:n], meta, capture_layers=self.capture_layers
        )
        self.hidden[:n].copy_(hidden)
        for buf, c in zip(self.captured, captured):
            buf[:n].copy_(c)

    def _capture(self) -> None:
        self.graphs, _, self.pool = capture_graphs(self.sizes, self._step, self.pool)

    def can_run(self, inp: ModelInput) -> bool:
        T = inp.num_tokens
        return (
            0 < T <= self.max_tokens
            and len(inp.query_lens) < self.num_seqs  # room for the dummy sequence of pad tokens
            and tuple(inp.capture_layers) == self.capture_layers
            and all(len(b) <= self.max_blocks for b in inp.block_tables)
        )

    def size_for(self, num_tokens: int) -> int:
        """The captured token count a step of ``num_tokens`` replays (the smallest that holds it)."""
        return next(n for n in self.sizes if n >= num_tokens)

    def run(
        self, inp: ModelInput, prev_tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Replay the graph for ``inp`` (``can_run``); returns (final hidden states of ``inp.logits_indices``
        [N, H], captured [T, H] each: copies, valid after later replays). The caller applies the LM head.

        With ``inp.prev_token_rows`` (async scheduling: prompts joining a step launched before the last one's
        readback) the decode rows' ids are gathered from ``prev_tokens`` ([N'] int64, the previous step's
        sampled ids) after the staged copy (``gather_prev_tokens``)."""
        T, N = inp.num_tokens, len(inp.logits_indices)
        n = self.size_for(T)
        self.stage.wait_sent()
        stage_mixed_inputs(self.stage, inp, n, self.num_seqs, self.max_blocks)
        rows = inp.prev_token_rows
        if rows is not None:
            self.stage.host("prev_rows")[:T] = rows
        self.stage.send()
        if rows is not None:
            st = self.stage
            gather_prev_tokens(st.on_device("input_ids")[:T], st.on_device("prev_rows")[:T], prev_tokens)
        if self.graphs:
            self.graphs[n].replay()
        else:
            self._step(n)
        rows = self.hidden[self.stage.on_device("logits_rows")[:N]]
        return rows, [c[:T].clone() for c in self.captured] if inp.keep_captured else []
