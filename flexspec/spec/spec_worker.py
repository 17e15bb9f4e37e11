"""The worker side of speculative decoding: target forward -> verification -> drafting, in one call.

Runs on every TP rank next to the target shard (the drafter is co-located, so it reads the target's hidden
states in place). Verification happens on rank 0 and its result is broadcast, so every rank's drafter sees
the same accepted tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flexspec.engine.model_input import ModelInput, ModelOutput
from flexspec.engine.sampler import SamplingMetadata
from flexspec.spec.base import DraftProposal, SeqDraftInput
from flexspec.spec.registry import build_drafter
from flexspec.spec.verifier import verify

if TYPE_CHECKING:
    from flexspec.engine.model_runner import ModelRunner


class SpecDecodeWorker:
    def __init__(self, runner: ModelRunner, config) -> None:
        self.runner = runner
        self.config = config
        self.drafter = build_drafter(config, runner)
        self.history: dict[int, list[int]] = {}  # seq id -> committed token ids
        self.pending_probs: dict[int, torch.Tensor | None] = {}  # seq id -> q of its pending drafts

    def _forget(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            self.history.pop(sid, None)
            self.pending_probs.pop(sid, None)
        if seq_ids:
            self.drafter.free(seq_ids)

    def can_run_plain(self, inp: ModelInput) -> bool:
        """Whether ``inp`` is a plain step the runner may launch without this worker: it proposes nothing,
        verifies no drafts, and the drafter keeps no per-step state (FlexDraft, n-gram) or updates it from the
        launched step without a host sync (DFlash, DSpark: ``observe_plain_step``); not EAGLE-3 / MTP /
        draft model."""
        drafter = self.drafter
        return (
            inp.num_speculative_tokens == 0
            and not any(inp.num_draft_tokens)
            and (not drafter.observes_every_step or drafter.observes_plain_steps)
        )

    def note_plain_step(self, inp: ModelInput) -> None:
        """Bookkeeping for a plain step the runner launches itself (``can_run_plain``), before its forward: free
        finished sequences, extend each history with the step's committed inputs (its sampled token is the next
        step's input, added then), forget pending draft distributions, and ask for the target layers the
        drafter reads (``observe_plain_step`` after the forward)."""
        self._forget(inp.finished_seq_ids)
        if self.drafter.observes_plain_steps:
            inp.capture_layers = self.drafter.capture_layers
        r = 0
        for sid, ctx, n in zip(inp.seq_ids, inp.context_lens, inp.query_lens):
            self._commit(sid, ctx, inp.input_ids[r : r + n])
            self.pending_probs[sid] = None
            r += n

    def _commit(self, sid: int, ctx: int, committed: list[int]) -> list[int]:
        """Sequence ``sid``'s history cut to its ``ctx`` cached tokens (dropping rejected drafts and anything
        past the cache) plus this step's ``committed`` inputs; returns the history list."""
        if ctx == 0 and sid in self.history:  # recomputed after preemption: start over
            self._forget([sid])
        hist = self.history.setdefault(sid, [])
        del hist[ctx:]
        hist.extend(committed)
        return hist

    @torch.inference_mode()
    def execute(self, inp: ModelInput) -> ModelOutput | None:
        runner = self.runner
        self._forget(inp.finished_seq_ids)
        inp.capture_layers = self.drafter.capture_layers
        side = self.drafter.begin_step(inp)
        logits, captured = runner.forward(inp, side=side)

        emit_idx = [s for s, smp in enumerate(inp.samples) if smp]
        num_drafts = [inp.num_draft_tokens[s] for s in emit_idx]
        emitted: list[list[int]] | None = None
        out: ModelOutput | None = None
        if runner.tp.is_first:
            qsl = _cumsum(inp.query_lens)
            drafts = [inp.input_ids[qsl[s + 1] - inp.num_draft_tokens[s] : qsl[s + 1]] for s in emit_idx]
            probs = [self.pending_probs.get(inp.seq_ids[s]) for s in emit_idx]
            meta = SamplingMetadata(inp.sampling_rows, runner.device, inp.num_logprobs)
            emitted = verify(logits, meta, num_drafts, drafts, probs) if emit_idx else []
            out = ModelOutput(token_ids=emitted)
            if inp.num_logprobs is not None:
                first_rows = _cumsum([d + 1 for d in num_drafts])[:-1]
                runner.attach_logprobs(out, logits, first_rows, inp.num_logprobs)
        emitted = runner.tp.broadcast_object(emitted)  # type: ignore[assignment]
        assert emitted is not None

        batch = self._draft_inputs(inp, emitted)
        if inp.num_speculative_tokens == 0 and not self.drafter.observes_every_step:
            proposal = DraftProposal(token_ids=[[] for _ in batch])  # a plain step: nothing to draft
        else:
            proposal = self.drafter.propose(batch, captured)
        for s in emit_idx:
            self.pending_probs[inp.seq_ids[s]] = proposal.draft_probs[s] if proposal.draft_probs else None
        if out is not None:
            out.draft_token_ids = [list(proposal.token_ids[s]) for s in emit_idx]
        return out

    def _draft_inputs(self, inp: ModelInput, emitted: list[list[int]]) -> list[SeqDraftInput]:
        batch: list[SeqDraftInput] = []
        qsl = _cumsum(inp.query_lens)
        k = 0
        row = 0  # first logits row of the next emitting sequence
        for s, sid in enumerate(inp.seq_ids):
            ctx, d = inp.context_lens[s], inp.num_draft_tokens[s]
            committed_inputs = inp.input_ids[qsl[s] : qsl[s + 1] - d]
            hist = self._commit(sid, ctx, committed_inputs)
            num_committed = len(committed_inputs)
            num_drafts = 0
            temperature, seed = 0.0, 0
            if inp.samples[s]:
                toks = emitted[k]
                k += 1
                hist.extend(toks)  # accepted drafts (computed this step) + bonus (not computed yet)
                num_committed += len(toks) - 1
                room = inp.max_lens[s] - len(hist) - 1
                num_drafts = max(0, min(inp.num_speculative_tokens, room))
                temperature, seed = inp.sampling_rows[row][0], inp.sampling_rows[row][3]
                row += d + 1
            batch.append(
                SeqDraftInput(
                    seq_id=sid,
                    token_ids=hist,
                    num_new_committed=num_committed,
                    hidden_rows=list(range(qsl[s], qsl[s] + num_committed)),
                    num_drafts=num_drafts,
                    temperature=temperature,
                    seed=seed,
                    emitted=inp.samples[s],
                )
            )
        return batch


def _cumsum(xs: list[int]) -> list[int]:
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out
