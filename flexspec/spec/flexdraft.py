"""FlexDraft drafter (arXiv 2605.20022): co-located attention-tuned last layers with flex decoding.

Two execution modes, chosen per batch by the engine's policy and identical on every TP rank:

* **parallel** — the verification forward also carries, for each sequence with d drafts, d+1 groups of B
  mask tokens: group k assumes k drafts get accepted, sits at positions E+k+1 .. E+k+B (E = position of the
  last committed input token) and sees the context, candidates[0..k] (through the KV cache the target writes
  in the same forward) and its own group bidirectionally; candidates never see mask tokens. After
  verification accepts a drafts, group a yields the next drafts: no extra forward.
* **decoupled** — verify first, then run only the tuned layers over one group placed after the accepted
  prefix (one small extra forward, B tokens per sequence).

Both apply the bonus-guided calibration and selective verification: drafts are kept while the cumulative
product of their top probabilities stays >= ``verification_threshold`` (at least one), so the next parallel
step builds only len+1 groups.
"""

from __future__ import annotations

import torch

from flexspec.engine.cuda_graphs import BatchGraphs
from flexspec.layers.attention import AttentionMetadata
from flexspec.models.loader import resolve_model_dir
from flexspec.models.side_stream import SideStream
from flexspec.spec.base import Drafter, DraftProposal, SeqDraftInput, confident_prefix_len
from flexspec.spec.models.flexdraft_model import FlexDraftModel
from flexspec.spec.registry import register
from flexspec_kernels import expand_mask_groups, top1_softmax


@register
class FlexDraftDrafter(Drafter):
    method = "flexdraft"
    observes_every_step = False

    def __init__(self, config, runner) -> None:
        super().__init__(config, runner)
        self.model = FlexDraftModel.from_pretrained(resolve_model_dir(config.model), runner.model)
        # Cast parameters only: the tuned attention shares the target's RoPE tables, which must stay fp32.
        for prm in self.model.parameters():
            prm.data = prm.data.to(device=runner.device, dtype=runner.dtype)
        self.block_size = self.model.cfg.block_size
        self.num_speculative_tokens = min(config.num_speculative_tokens, self.block_size - 1)
        self.threshold = config.verification_threshold
        self.start_layer = self.model.cfg.split_layer
        self.max_position = runner.spec.max_position_embeddings - 1
        self._inp = None
        self._groups: dict[int, int] = {}  # batch index -> first group row in the side stream
        self._side: SideStream | None = None
        self._graphs: BatchGraphs | None = None  # decoupled drafting, captured per batch size on GPU
        self.last_mode = "decoupled"

    def memory_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def allocate(self, num_kv_blocks: int) -> None:
        # Mask tokens read the target's cache of each tuned layer (and never write to it).
        for tuned, i in zip(self.model.layers, self.model.cfg.tuned_layer_ids):
            core, target_core = tuned.self_attn.attn, self.runner.model.layers[i].self_attn.attn
            core.k_cache, core.v_cache = target_core.k_cache, target_core.v_cache

    # ---- side-stream construction -------------------------------------------------------------------------
    def _side_stream(
        self, last_pos: torch.Tensor, num_groups: torch.Tensor, tables: torch.Tensor, total_groups: int
    ) -> SideStream:
        """Mask-token groups on the device: sequence i (last committed position ``last_pos[i]`` [S] int64,
        block-table row ``tables[i]`` [S, W] int32) gets ``num_groups[i]`` ([S] int32) groups; group k sits at
        positions last_pos[i]+k+1 .. +B with context length last_pos[i]+k+1 (see the module doc). Expanded by
        ``flexspec_kernels.expand_mask_groups`` (Triton on GPU); ``total_groups`` = num_groups.sum() as a host int, so
        nothing here syncs (the decoupled step is captured in a CUDA graph)."""
        B = self.block_size
        g = expand_mask_groups(last_pos, num_groups, tables, B, total_groups, self.max_position)
        meta = AttentionMetadata(
            positions=g.positions,
            slot_mapping=g.slot_mapping,
            block_tables=g.block_tables,
            context_lens=g.context_lens,
            query_start_loc=g.query_start_loc,
            max_query_len=B,
            mask=g.mask,  # bidirectional inside each group
            mask_start_loc=g.mask_start_loc,
        )
        hidden = self.model.mask_embedding.to(self.runner.dtype).expand(total_groups * B, -1)
        return SideStream(start_layer=self.start_layer, hidden=hidden, meta=meta, attn=self.model.attn)

    def _device(self, rows: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(rows, dtype=dtype).to(self.runner.device, non_blocking=True)

    def _tables(self, tables: list[list[int]]) -> torch.Tensor:
        width = max(len(t) for t in tables) or 1
        return self._device([t + [0] * (width - len(t)) for t in tables], torch.int32)

    def _calibrated_drafts(
        self, hidden: torch.Tensor, bonus: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [S, B-1, H] (final-norm mask tokens after the bonus), bonus [S] int64 ->
        (drafts [S, k] int64, verification length [S] int64 >= 1: drafts kept while the cumulative product of
        their top probabilities stays >= ``verification_threshold``), k = ``num_speculative_tokens``: the LM head
        runs on the k mask tokens that can become drafts only (all B-1 still attend to each other)."""
        hidden = hidden[:, : self.num_speculative_tokens]
        S, n = hidden.shape[:2]
        logits = self.model.draft_logits(hidden.reshape(S * n, -1), bonus.repeat_interleave(n))  # [S*n, V]
        probs, tokens = top1_softmax(logits)
        return tokens.view(S, n), confident_prefix_len(probs.view(S, n), self.threshold)

    def _decoupled_step(
        self, last_pos: torch.Tensor, tables: torch.Tensor, bonus: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoupled drafting for S sequences: one group each after the bonus (position last_pos + 1), only the
        tuned layers. last_pos [S] int64, tables [S, W] int32, bonus [S] int64 -> ``_calibrated_drafts``."""
        S, B = last_pos.shape[0], self.block_size
        side = self._side_stream(last_pos, torch.ones_like(last_pos, dtype=torch.int32), tables, S)
        hidden = self.runner.model.forward_side_only(side).view(S, B, -1)[:, 1:]
        return self._calibrated_drafts(hidden, bonus)

    def capture_graphs(self, batch_sizes: list[int]) -> None:
        runner = self.runner
        sizes = [b for b in batch_sizes if b <= runner.config.max_num_seqs]
        inputs = {
            "last_pos": ((), torch.int64, 0),
            "tables": ((runner.max_blocks_per_seq,), torch.int32, 0),
            "bonus": ((), torch.int64, 0),
        }
        self._graphs = BatchGraphs(self._decoupled_step, inputs, sizes, runner.device) if sizes else None

    def begin_step(self, inp):
        self._inp, self._groups, self._side = inp, {}, None
        self.last_mode = inp.spec_mode
        if inp.spec_mode != "parallel" or inp.num_speculative_tokens == 0:
            return None
        tables, last_pos, num_groups = [], [], []
        total = 0
        for s in range(len(inp.seq_ids)):
            if not inp.samples[s]:
                continue
            d = inp.num_draft_tokens[s]
            self._groups[s] = total
            tables.append(inp.block_tables[s])
            last_pos.append(inp.context_lens[s] + inp.query_lens[s] - 1 - d)  # last committed input position
            num_groups.append(d + 1)
            total += d + 1
        if not tables:
            return None
        self._side = self._side_stream(
            self._device(last_pos, torch.int64),
            self._device(num_groups, torch.int32),
            self._tables(tables),
            total,
        )
        return self._side

    # ---- drafting -----------------------------------------------------------------------------------------
    proposes_on_device = True  # decoupled steps; parallel steps carry a side stream and verify on the host

    @torch.inference_mode()
    def propose_on_device(
        self, inp, tokens: torch.Tensor, accepted: torch.Tensor, captured: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``Drafter.propose_on_device`` for a decoupled step: the group after the new last token
        ``tokens[s, a]``, whose predecessor, the last committed input, sits at position ``context_lens[s] + a``
        (a decode query) or ``context_lens[s] + query_lens[s] - 1`` (a prompt chunk; the target wrote its KV in
        the verification forward); the same graph as ``propose``. Groups of chunks that emit nothing are
        computed and dropped by the worker."""
        if inp.num_speculative_tokens == 0:  # the step only verifies: FlexDraft keeps no per-step state
            return accepted.new_zeros(tokens.shape[0], 0), accepted.new_zeros(tokens.shape[0])
        width = max(len(t) for t in inp.block_tables) or 1
        host = torch.tensor(
            [[c + q - 1 - d, *t, *[0] * (width - len(t))]
             for c, q, d, t in zip(inp.context_lens, inp.query_lens, inp.num_draft_tokens, inp.block_tables)],
            dtype=torch.int64,
        )  # fmt: skip
        meta = host.to(self.runner.device, non_blocking=True)  # [S, 1 + W]
        last_pos = meta[:, 0] + accepted  # [S]
        tables = meta[:, 1:].to(torch.int32)  # [S, W]
        bonus = tokens.gather(1, accepted[:, None]).squeeze(1)  # [S]
        S, graphs = tokens.shape[0], self._graphs
        if graphs is not None and graphs.can_run(S, tables=tables):
            return graphs.run(S, last_pos=last_pos, tables=tables, bonus=bonus)
        return self._decoupled_step(last_pos, tables, bonus)

    @torch.inference_mode()
    def propose(self, batch: list[SeqDraftInput], captured: list[torch.Tensor]) -> DraftProposal:
        inp, B = self._inp, self.block_size
        assert inp is not None
        parallel: dict[
            int, int
        ] = {}  # batch index -> first row of its chosen group in the side stream's output
        if self._side is not None and self._side.out is not None:
            for s, first in self._groups.items():
                item = batch[s]
                if item.num_drafts == 0:
                    continue
                d, n = inp.num_draft_tokens[s], inp.query_lens[s]
                accepted = item.num_new_committed - (n - d)
                parallel[s] = (first + min(accepted, d)) * B
        decoupled = [s for s, item in enumerate(batch) if item.num_drafts > 0 and s not in parallel]
        results: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []  # (batch indices, drafts, lengths)
        if parallel:
            order = sorted(parallel)
            rows = self._device([parallel[s] + j for s in order for j in range(1, B)], torch.int64)
            hidden = self._side.out[rows].view(len(order), B - 1, -1)
            bonus = self._device([batch[s].token_ids[-1] for s in order], torch.int64)
            results.append((order, *self._calibrated_drafts(hidden, bonus)))
        if decoupled:
            last_pos = self._device(
                [len(batch[s].token_ids) - 2 for s in decoupled], torch.int64
            )  # bonus at L-1
            tables = self._tables([inp.block_tables[s] for s in decoupled])
            bonus = self._device([batch[s].token_ids[-1] for s in decoupled], torch.int64)
            graphs = self._graphs
            if graphs is not None and graphs.can_run(len(decoupled), tables=tables):
                drafts, keep = graphs.run(len(decoupled), last_pos=last_pos, tables=tables, bonus=bonus)
            else:
                drafts, keep = self._decoupled_step(last_pos, tables, bonus)
            results.append((decoupled, drafts, keep))
        out: list[list[int]] = [[] for _ in batch]
        for order, drafts, keep in results:
            rows = torch.cat([drafts, keep.view(-1, 1).to(drafts.dtype)], 1).tolist()  # one readback
            for s, row in zip(order, rows):
                out[s] = row[: min(row[-1], batch[s].num_drafts)]
        self._side = None
        return DraftProposal(token_ids=out)
