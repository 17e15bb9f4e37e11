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

from flexspec.layers.attention import AttentionMetadata
from flexspec.models.loader import resolve_model_dir
from flexspec.models.side_stream import SideStream
from flexspec.spec.base import Drafter, DraftProposal, SeqDraftInput
from flexspec.spec.models.flexdraft_model import FlexDraftModel
from flexspec.spec.registry import register
from kernels import expand_mask_groups


@register
class FlexDraftDrafter(Drafter):
    method = "flexdraft"

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
        self.last_mode = "decoupled"

    def memory_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def allocate(self, num_kv_blocks: int) -> None:
        # Mask tokens read the target's cache of each tuned layer (and never write to it).
        for tuned, i in zip(self.model.layers, self.model.cfg.tuned_layer_ids):
            core, target_core = tuned.self_attn.attn, self.runner.model.layers[i].self_attn.attn
            core.k_cache, core.v_cache = target_core.k_cache, target_core.v_cache

    # ---- side-stream construction -------------------------------------------------------------------------
    def _side_stream(self, tables: list[list[int]], last_pos: list[int], num_groups: list[int]) -> SideStream:
        """Mask-token groups for sequences with these block tables: sequence i gets ``num_groups[i]`` groups,
        group k at positions last_pos[i]+k+1 .. +B with context length last_pos[i]+k+1 (see the module doc).
        Inputs are expanded on the device by ``kernels.expand_mask_groups`` (Triton on GPU)."""
        dev, B = self.runner.device, self.block_size
        width = max(len(t) for t in tables) or 1
        G = sum(num_groups)
        g = expand_mask_groups(
            torch.tensor(last_pos, dtype=torch.int64).to(dev, non_blocking=True),
            torch.tensor(num_groups, dtype=torch.int32).to(dev, non_blocking=True),
            torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32).to(dev, non_blocking=True),
            B,
            G,
            self.max_position,
        )
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
        hidden = self.model.mask_embedding.to(self.runner.dtype).expand(G * B, -1)
        return SideStream(start_layer=self.start_layer, hidden=hidden, meta=meta, attn=self.model.attn)

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
        self._side = self._side_stream(tables, last_pos, num_groups)
        return self._side

    # ---- drafting -----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, batch: list[SeqDraftInput], captured: list[torch.Tensor]) -> DraftProposal:
        inp, B = self._inp, self.block_size
        assert inp is not None
        rows: dict[int, int] = {}  # batch index -> first row of its chosen group in `hidden`
        pieces: list[torch.Tensor] = []
        base = 0
        if self._side is not None and self._side.out is not None:
            for s, first in self._groups.items():
                item = batch[s]
                if item.num_drafts == 0:
                    continue
                d, n = inp.num_draft_tokens[s], inp.query_lens[s]
                accepted = item.num_new_committed - (n - d)
                rows[s] = (first + min(accepted, d)) * B
            pieces.append(self._side.out)
            base = self._side.out.shape[0]
        decoupled = [s for s, item in enumerate(batch) if item.num_drafts > 0 and s not in rows]
        if decoupled:
            side = self._side_stream(
                [inp.block_tables[s] for s in decoupled],
                [len(batch[s].token_ids) - 2 for s in decoupled],  # the bonus (not yet computed) is at L-1
                [1] * len(decoupled),
            )
            pieces.append(self.runner.model.forward_side_only(side))
            for k, s in enumerate(decoupled):
                rows[s] = base + k * B
        out: list[list[int]] = [[] for _ in batch]
        if rows:
            hidden = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
            order = sorted(rows)
            idx = torch.tensor([rows[s] + j for s in order for j in range(1, B)], device=hidden.device)
            bonus = torch.tensor([batch[s].token_ids[-1] for s in order for _ in range(1, B)], device=hidden.device)
            logits = self.model.draft_logits(hidden[idx], bonus)  # [S*(B-1), V]
            probs, tokens = logits.softmax(-1).max(-1)
            conf = probs.view(len(order), B - 1).double().cumprod(-1)
            keep = (conf >= self.threshold).sum(-1).clamp(min=1).tolist()
            tokens_l = tokens.view(len(order), B - 1).tolist()
            for k, s in enumerate(order):
                out[s] = tokens_l[k][: min(keep[k], batch[s].num_drafts)]
        self._side = None
        return DraftProposal(token_ids=out)
