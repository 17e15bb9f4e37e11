"""Draft-model speculation (Leviathan et al. 2211.17192): a smaller LM with the target's tokenizer proposes
k tokens autoregressively, with a paged KV cache of its own.

At temperature 0 drafts are the draft model's argmax (deterministic); above it, drafts are sampled from the
draft's temperature-scaled distribution q, which is returned for rejection sampling.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from flexspec.engine.model_input import ModelInput
from flexspec.spec.base import Drafter, DraftProposal, SeqDraftInput
from flexspec.spec.registry import register


@dataclass
class _DraftSeq:
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0  # committed positions whose draft-model K/V are cached


@register
class DraftModelDrafter(Drafter):
    method = "draft_model"

    def __init__(self, config, runner) -> None:
        super().__init__(config, runner)
        from flexspec.engine.model_runner import ModelRunner

        target_cfg = runner.config
        draft_cfg = target_cfg.model_copy(
            update={
                "model": config.model,
                "speculative_config": None,
                "max_model_len": target_cfg.max_model_len + self.num_speculative_tokens,
                "num_kv_blocks": None,
            }
        )
        self.draft = ModelRunner(
            draft_cfg, tp=runner.tp if config.draft_tensor_parallel_size != 1 else None, device=runner.device
        )
        if self.draft.spec.vocab_size != runner.spec.vocab_size:
            raise ValueError(
                f"draft model vocab {self.draft.spec.vocab_size} != target vocab {runner.spec.vocab_size}: "
                "draft_model needs the target's tokenizer"
            )
        self.block_size = draft_cfg.kv_block_size
        self.seqs: dict[int, _DraftSeq] = {}
        self.free_blocks: deque[int] = deque()

    def memory_bytes(self) -> int:
        """Weights + buffers (RoPE tables) + the cache's slack of one sequence beyond the target's block count
        (``allocate``); the per-target-block part of the cache is ``kv_bytes_per_block``."""
        tensors = [*self.draft.model.parameters(), *self.draft.model.buffers()]
        weights = sum(t.numel() * t.element_size() for t in tensors)
        return weights + self.draft.max_blocks_per_seq * self.draft.kv_bytes_per_block()

    def kv_bytes_per_block(self) -> int:
        return self.draft.kv_bytes_per_block()  # same block size: one draft block per target block

    def allocate(self, num_kv_blocks: int) -> None:
        cfg = self.draft.config.model_copy(
            update={"num_kv_blocks": num_kv_blocks + self.draft.max_blocks_per_seq}
        )
        self.draft.config = cfg
        n = self.draft.allocate_kv_cache()
        self.free_blocks = deque(range(n))

    def free(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            st = self.seqs.pop(sid, None)
            if st is not None:
                self.free_blocks.extend(st.blocks)

    def _ensure_blocks(self, st: _DraftSeq, num_tokens: int) -> None:
        need = -(-num_tokens // self.block_size) - len(st.blocks)
        if need > len(self.free_blocks):
            raise RuntimeError("draft model KV cache exhausted")
        st.blocks.extend(self.free_blocks.popleft() for _ in range(max(0, need)))

    def _slot(self, st: _DraftSeq, pos: int) -> int:
        return st.blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    @torch.inference_mode()
    def propose(self, batch: list[SeqDraftInput], captured: list[torch.Tensor]) -> DraftProposal:
        active = [b for b in batch if b.num_drafts > 0]
        drafts: dict[int, list[int]] = {b.seq_id: [] for b in active}
        probs: dict[int, list[torch.Tensor]] = {b.seq_id: [] for b in active}
        if active:
            # Step 0: catch up on committed tokens (incl. the bonus) -> first draft from the last logits row.
            inp = ModelInput([], [], [], [], [], [], [])
            for b in active:
                st = self.seqs.setdefault(b.seq_id, _DraftSeq())
                L = len(b.token_ids)
                st.num_computed = min(st.num_computed, L - 1)
                self._ensure_blocks(st, L + b.num_drafts)
                toks = b.token_ids[st.num_computed : L]
                inp.input_ids.extend(toks)
                for pos in range(st.num_computed, L):
                    inp.positions.append(pos)
                    inp.slot_mapping.append(self._slot(st, pos))
                inp.block_tables.append(st.blocks)
                inp.context_lens.append(st.num_computed)
                inp.query_lens.append(len(toks))
                inp.logits_indices.append(len(inp.input_ids) - 1)
                st.num_computed = L
            logits, _ = self.draft.forward(inp)
            self._pick(active, logits, drafts, probs, step=0)
            # Steps 1..k-1: one token per sequence that still wants drafts (pure decode; CUDA graphs apply).
            for step in range(1, max(b.num_drafts for b in active)):
                live = [b for b in active if b.num_drafts > step]
                inp = ModelInput([], [], [], [], [], [], [])
                for b in live:
                    st = self.seqs[b.seq_id]
                    pos = len(b.token_ids) + step - 1
                    inp.input_ids.append(drafts[b.seq_id][-1])
                    inp.positions.append(pos)
                    inp.slot_mapping.append(self._slot(st, pos))
                    inp.block_tables.append(st.blocks)
                    inp.context_lens.append(pos)
                    inp.query_lens.append(1)
                    inp.logits_indices.append(len(inp.input_ids) - 1)
                logits, _ = self.draft.forward(inp)
                self._pick(live, logits, drafts, probs, step)
        token_ids = [drafts.get(b.seq_id, []) for b in batch]
        draft_probs = [torch.stack(probs[b.seq_id]) if probs.get(b.seq_id) else None for b in batch]
        return DraftProposal(token_ids=token_ids, draft_probs=draft_probs)

    def _pick(self, items, logits, drafts, probs, step: int) -> None:
        greedy = logits.argmax(-1).tolist()
        for i, b in enumerate(items):
            if b.temperature > 0:
                q = torch.softmax(logits[i].float() / b.temperature, -1)
                gen = torch.Generator(device=q.device).manual_seed(
                    (b.seed * 1_000_003 + len(b.token_ids) * 64 + step) & 0x7FFF_FFFF_FFFF_FFFF
                )
                tok = int(torch.multinomial(q, 1, generator=gen))
                drafts[b.seq_id].append(tok)
                probs[b.seq_id].append(q)
            else:
                drafts[b.seq_id].append(greedy[i])
