"""Drafting loop shared by EAGLE-3 and MTP: one small network chained over target features, autoregressively.

Convention (EAGLE, arXiv 2401.15077 / 2503.01840; DeepSeek-V3 MTP): the network's input at position ``p`` is
the pair (feature of position ``p``, embedding of token ``p+1``); its output there predicts token ``p+2`` and
its K/V are cached at ``p``. With ``L`` committed tokens (the last, the bonus, has no target feature yet):

1. *Context step* (one varlen forward for the whole batch): every committed position whose next token is known
   (``p <= L-2``) and whose K/V are not cached yet goes through the network with the TARGET's feature, K/V
   written to the drafter's paged cache at ``p`` (kept for good). The output at ``p = L-2`` gives draft 1. A
   prefill chunk's last position waits (its feature is kept) until its next token is known.
2. *Draft steps* ``j = 1 .. k-1``: input (network's own output hidden at the previous step, draft ``j``) at
   position ``L-2+j``, K/V written at that position too — scratch, overwritten by the target's feature once
   the position is committed (the next context step starts exactly there).

Drafts are the argmax of the draft logits (deterministic drafts; exact at T > 0 through the verifier's
deterministic-draft rule).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from flexspec.spec.base import Drafter, DraftProposal, SeqDraftInput
from flexspec.spec.models.draft_kv import DraftKVCache


@dataclass
class _ChainSeq:
    num_ctx: int = 0  # positions 0 .. num_ctx-1 hold K/V computed from target features
    pending: torch.Tensor | None = None  # [1, H] feature of position num_ctx, waiting for token num_ctx + 1


class FeatureChainDrafter(Drafter):
    """Subclasses set ``self.net`` (``forward(token_embeds [T, H], hidden [T, H], meta) -> (logit_hidden,
    feedback)`` both [T, H]), ``self.cache`` (bound to the net's attention layers in ``allocate``) and
    ``self.device``, and define how target features, token embeddings and logits are made."""

    net: nn.Module
    cache: DraftKVCache
    device: torch.device

    def __init__(self, config, runner) -> None:
        super().__init__(config, runner)
        self.seqs: dict[int, _ChainSeq] = {}

    @abstractmethod
    def attention_layers(self) -> list[nn.Module]:
        """The net's attention cores, in cache-layer order."""

    @abstractmethod
    def features(self, captured: list[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        """Target features of captured rows [N] -> [N, H] network hidden input."""

    @abstractmethod
    def embed(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[T] tokens at [T] positions -> [T, H] token embeddings."""

    @abstractmethod
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] logit hidden states -> fp32 [N, V] over the target vocabulary."""

    # ---- Drafter interface --------------------------------------------------------------------------------
    def memory_bytes(self) -> int:
        weights = sum(p.numel() * p.element_size() for p in self.net.parameters())
        return weights + self.cache.reserved_bytes()

    def allocate(self, num_kv_blocks: int) -> None:
        self.cache.allocate(num_kv_blocks)
        self.cache.bind(self.attention_layers())

    def free(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            self.seqs.pop(sid, None)
            self.cache.free(sid)

    @torch.inference_mode()
    def propose(self, batch: list[SeqDraftInput], captured: list[torch.Tensor]) -> DraftProposal:
        drafts: dict[int, list[int]] = {}
        feedback: dict[int, torch.Tensor] = {}  # seq id -> [H] output hidden of its last step
        self._context_step(batch, captured, drafts, feedback)
        live = [b for b in batch if b.seq_id in drafts]
        for step in range(1, max((self._wanted(b) for b in live), default=0)):
            live = [b for b in live if self._wanted(b) > step]
            self._draft_step(live, step, drafts, feedback)
        return DraftProposal(token_ids=[drafts.get(b.seq_id, []) for b in batch])

    # ---- steps --------------------------------------------------------------------------------------------
    def _wanted(self, b: SeqDraftInput) -> int:
        return min(b.num_drafts, self.num_speculative_tokens) if b.emitted else 0

    def _context_step(
        self,
        batch: list[SeqDraftInput],
        captured: list[torch.Tensor],
        drafts: dict[int, list[int]],
        feedback: dict[int, torch.Tensor],
    ) -> None:
        rows = [r for b in batch for r in b.hidden_rows]
        feats = self.features(captured, torch.tensor(rows, device=self.device)) if rows else None  # [N, H]
        evictable = set(self.cache.tables) - {b.seq_id for b in batch}
        seq_ids, positions, ctx_lens, tokens, hidden, drafting = [], [], [], [], [], []
        offset = 0
        for b in batch:
            n, L = b.num_new_committed, len(b.token_ids)
            new = feats[offset : offset + n] if feats is not None else None
            offset += n
            st = self.seqs.setdefault(b.seq_id, _ChainSeq())
            end = L - 1 if b.emitted else L  # new features cover positions [end - n, end)
            first = end - n
            if st.pending is not None and st.num_ctx + 1 == first:
                new = st.pending if new is None or n == 0 else torch.cat([st.pending, new])
                first = st.num_ctx
            st.pending = None
            todo = max(0, min(end, L - 1) - first)  # positions whose next token is known
            if new is not None and new.shape[0] > todo:
                st.pending = new[todo : todo + 1].clone()  # the prefill chunk's last position
            if todo == 0:
                st.num_ctx = first  # only a pending position (a one-token prefill chunk)
                continue
            if not self.cache.reserve(b.seq_id, L + self._wanted(b), evictable):
                self.seqs.pop(b.seq_id, None)  # out of cache blocks: start over (gap) later
                continue
            assert new is not None
            seq_ids.append(b.seq_id)
            positions.append(list(range(first, first + todo)))
            ctx_lens.append(first)
            tokens.extend(b.token_ids[first + 1 : first + 1 + todo])
            hidden.append(new[:todo])
            st.num_ctx = first + todo
            drafting.append(self._wanted(b) > 0 and st.num_ctx == L - 1)
        if not seq_ids:
            return
        meta = self.cache.metadata(seq_ids, positions, ctx_lens, store=True)
        embeds = self.embed(torch.tensor(tokens, device=self.device), meta.positions)
        out, back = self.net(embeds, torch.cat(hidden), meta)  # [T, H] each
        picks = [i for i, d in enumerate(drafting) if d]
        if picks:
            last = torch.tensor([len(p) for p in positions]).cumsum(0) - 1  # each sequence's last row
            idx = last[picks].to(self.device)
            first_drafts = self.logits(out.index_select(0, idx)).argmax(-1).tolist()
            back_rows = back.index_select(0, idx)
            for j, i in enumerate(picks):
                drafts[seq_ids[i]] = [first_drafts[j]]
                feedback[seq_ids[i]] = back_rows[j]

    def _draft_step(
        self,
        live: list[SeqDraftInput],
        step: int,
        drafts: dict[int, list[int]],
        feedback: dict[int, torch.Tensor],
    ) -> None:
        sids = [b.seq_id for b in live]
        pos = [len(b.token_ids) - 2 + step for b in live]  # input: draft `step` at position L-2+step
        meta = self.cache.metadata(sids, [[p] for p in pos], pos, store=True)
        tokens = torch.tensor([drafts[s][-1] for s in sids], device=self.device)
        out, back = self.net(
            self.embed(tokens, meta.positions), torch.stack([feedback[s] for s in sids]), meta
        )
        nxt = self.logits(out).argmax(-1).tolist()
        for i, s in enumerate(sids):
            drafts[s].append(nxt[i])
            feedback[s] = back[i]
