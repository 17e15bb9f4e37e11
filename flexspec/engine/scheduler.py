"""Continuous batching with chunked prefill, mixed prefill + decode steps, and preemption by recompute.

Every running sequence is described by ``num_computed_tokens``: each step the scheduler grants it the next
``n`` tokens to compute (1 + draft tokens while decoding, a chunk of the prompt while prefilling), within a
per-step token budget, and grows its KV blocks to match. When blocks run out, the most recently admitted
sequence is preempted (its blocks freed, its tokens recomputed later), as in vLLM's recompute policy.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from configs.engine import EngineConfig
from flexspec.engine.block_manager import BlockManager
from flexspec.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # tokens computed this step, draft tokens included
    num_draft_tokens: int  # trailing draft tokens among them (verified this step)

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence, so the step emits tokens for it."""
        s = self.seq
        return s.num_computed_tokens + self.num_new_tokens == len(s.token_ids) + self.num_draft_tokens

    @property
    def token_ids(self) -> list[int]:
        s = self.seq
        start = s.num_computed_tokens
        end = start + self.num_new_tokens
        ids = s.token_ids[
            start:end
        ]  # slice before joining: a decode step copies 1 + drafts ids, not the sequence
        if end > len(s.token_ids):
            ids += s.draft_token_ids[: end - len(s.token_ids)]
        return ids


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence]
    preempted: list[Sequence]
    # scheduled sequences computing prompt tokens (a prompt joining the batch, a chunked prompt going on, a
    # preempted sequence recomputed) rather than decoding or verifying drafts; counted while scheduling (the
    # policy reads it every step)
    num_prefills: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_pure_decode(self) -> bool:
        return all(s.num_new_tokens == 1 and s.samples for s in self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, preempt: bool = True) -> SchedulerOutput | None:
        """The next step's sequences and token counts (see the module doc). With the speculative config's
        ``separate_prefill_steps``, a step that prefills carries no decode or verification queries while
        running requests have drafts to verify: those wait one step (see ``_defers_decodes``).

        ``preempt=False`` (a step scheduled ahead of the previous step's result, whose finished requests
        still hold their blocks): returns None instead of preempting when a running sequence's blocks cannot
        grow; the caller schedules again once that result is applied. Blocks allocated before that point
        stay with their sequences (their next tokens need them anyway)."""
        if self._defers_decodes():
            out = self._schedule(defer_decodes=True, preempt=preempt)
            if out is None or out.scheduled:
                return out
            # nothing could be prefilled after all
            more = self._schedule(defer_decodes=False, preempt=preempt)
            if more is None:
                return None
            return SchedulerOutput(more.scheduled, out.preempted + more.preempted, more.num_prefills)
        return self._schedule(defer_decodes=False, preempt=preempt)

    def _defers_decodes(self) -> bool:
        """Whether this step should prefill only: separate prefill steps are on, some running request has
        draft tokens to verify, and a prompt is waiting to be admitted or still being prefilled (chunked).

        Why: a verification step that also prefills cannot take the device-side verification path nor the
        decode CUDA graphs; it verifies on the host. Prefilling first (as vLLM's V0 scheduler always did)
        keeps every verification step pure, at the cost of one step in which running requests wait. Draft trees
        (``draft_tree_topk`` > 1) always separate them: no graph of steps that prefill carries tree masks, so such
        a step ran eagerly (~4-10x the time of a tree step on an H100 at b=4-64, session 34)."""
        spec = self.config.speculative_config
        if spec is None or not (spec.separate_prefill_steps or getattr(spec, "draft_tree_topk", 1) > 1):
            return False
        decoding, prefilling = False, False
        for seq in self.running:
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if len(seq.token_ids) - seq.num_computed_tokens > 1:
                prefilling = True
            elif seq.draft_token_ids:
                decoding = True
        if not decoding:
            return False
        if prefilling:
            return True
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return False
        seq = self.waiting[0]
        n = min(seq.num_uncomputed_tokens, self.config.max_num_batched_tokens)
        if n < seq.num_uncomputed_tokens and not self.config.enable_chunked_prefill:
            return False
        return self.block_manager.can_allocate(seq, seq.num_computed_tokens + n)

    def _schedule(self, defer_decodes: bool, preempt: bool = True) -> SchedulerOutput | None:
        budget = self.config.max_num_batched_tokens
        max_len = self.config.max_model_len
        scheduled: list[ScheduledSequence] = []
        preempted: list[Sequence] = []
        prefills = 0
        bm = self.block_manager

        block_size = bm.block_size
        running = SequenceStatus.RUNNING
        queue = list(self.running)
        for i, seq in enumerate(queue):
            if budget == 0:
                break
            if seq.status is not running:
                continue
            computed = seq.num_computed_tokens
            uncomputed = len(seq.token_ids) - computed
            if defer_decodes and uncomputed <= 1:
                continue  # a decode / verification query: it waits for the prefill step
            room = min(budget, max_len - computed)
            if seq.draft_token_ids:
                # Draft tokens must fit the budget and max_model_len; otherwise verify fewer of them. They leave a
                # token for each request queued after this one, so drafts never take a running request's step
                # (draft trees of many nodes; at most len(queue) - i - 1 of the budget, an upper bound).
                spare = min(room, budget - (len(queue) - i - 1))
                drafts = max(0, min(len(seq.draft_token_ids), spare - uncomputed))
                n = min(uncomputed + drafts, room)
            else:
                drafts, n = 0, min(uncomputed, room)
            if computed + n > len(seq.block_table) * block_size:  # needs new blocks (most steps do not)
                if not preempt and not bm.can_allocate(seq, computed + n):
                    return None
                while not bm.can_allocate(seq, computed + n):
                    victim = self.running[-1]
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is seq:
                        break
                if seq.status is not SequenceStatus.RUNNING:
                    continue
                bm.allocate(seq, computed + n)
            scheduled.append(ScheduledSequence(seq, n, drafts))
            prefills += uncomputed > 1
            budget -= n

        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed_tokens, budget)
            if n < seq.num_uncomputed_tokens and not self.config.enable_chunked_prefill:
                break
            if not bm.can_allocate(seq, seq.num_computed_tokens + n):
                break
            self.waiting.popleft()
            bm.allocate(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSequence(seq, n, 0))
            prefills += 1
            budget -= n
        return SchedulerOutput(scheduled, preempted, prefills)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.draft_token_ids = []
        seq.draft_parents = None
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished (or aborted) and free its KV blocks."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
