"""Async scheduling (vLLM's feature of the same name): step N+1 is scheduled on top of step N's provisional
result and, when it is a plain step (pure decode, or decode with prompts joining), launched before N's sampled
ids reach the host.

:class:`AsyncSchedulingMixin` holds the engine's side of it; :class:`~flexspec.engine.llm_engine.LLMEngine`
decides when to use it (``_step``). The device side (input ids gathered from the previous step's sampled ids
before the graph's replay, the decode rows' only in a step where prompts join) is ``ModelInput.prev_token_rows``
in the model runner.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flexspec.engine.model_input import PLACEHOLDER_TOKEN_ID, ModelInput
from flexspec.engine.scheduler import SchedulerOutput
from flexspec.engine.sequence import SequenceStatus
from flexspec.spec.policy import Decision

FINISHED = SequenceStatus.FINISHED

if TYPE_CHECKING:
    from flexspec.engine.llm_engine import _Step
    from flexspec.engine.outputs import RequestOutput


class AsyncSchedulingMixin:
    """Scheduling and launching a plain step ahead of the previous step's readback (part of ``LLMEngine``)."""

    # provided by LLMEngine
    config: Any
    executor: Any
    scheduler: Any
    stats: Any
    policy: Any
    _inflight: Any
    overlaps_output_processing: bool

    @property
    def schedules_ahead(self) -> bool:
        """Whether plain decode steps are scheduled and launched before the previous step's tokens are read
        back (``EngineConfig.async_scheduling``, with overlapped output processing in one process). With a
        drafter only plain steps that follow plain steps (the policy decided plain decoding) are."""
        on = self.config.async_scheduling
        if on is None:
            on = getattr(self.executor, "device_type", "cpu") == "cuda"
        return bool(on) and self.overlaps_output_processing

    @staticmethod
    def _is_plain(inp: ModelInput) -> bool:
        """A step that verifies no drafts and proposes none: one sampled token per emitting sequence."""
        return inp.num_speculative_tokens == 0 and not any(inp.num_draft_tokens)

    def _schedule_ahead(self, st: _Step) -> SchedulerOutput:
        """Apply the launched, uncollected step ``st`` provisionally and schedule the next step on top of it.

        Each sequence that samples in ``st`` gets a placeholder id (its sampled id, read back later) and its
        computed tokens advanced, exactly as ``_step`` would after collecting; one that certainly finishes
        with ``st``'s token (it reaches ``max_tokens`` or ``max_model_len``) is held out of the running list
        instead, so that nothing is computed for it. Returns the next step's batch (possibly empty); ``_step``
        launches it at once when it is a pure decode step of ``st``'s sequences (ids gathered on the device),
        otherwise after ``st`` is collected (``_step_after``). ``st`` must be a plain step (``_is_plain``)."""
        held_out: list[int] = []
        running = self.scheduler.running
        for s, samples in zip(st.sched.scheduled, st.inp.samples):
            seq = s.seq
            if seq.status is FINISHED:
                continue
            if not samples:
                seq.num_computed_tokens += s.num_new_tokens
            elif len(seq.token_ids) + 1 >= seq.max_len:  # st's token reaches max_tokens or max_model_len
                held_out.append(seq.seq_id)
                running.remove(seq)  # finished by _append_ids when st is collected
            else:
                seq.num_computed_tokens += s.num_new_tokens
                seq.token_ids.append(PLACEHOLDER_TOKEN_ID)
                # st proposes nothing: after it the sequence has no drafts (stale ones from an earlier step
                # that st did not verify, e.g. for lack of token budget, must not be scheduled on top of it)
                if seq.draft_token_ids:
                    seq.draft_token_ids = []
                    seq.draft_parents = None
        st.provisional, st.held_out = True, frozenset(held_out)
        # Never preempt here: a request that ends on EOS / a stop string with ``st``'s token still holds its
        # blocks, so preempting now could evict a request that scheduling after ``st`` would keep; such a step
        # is scheduled after ``st`` is applied instead (an empty batch makes ``_step_after`` schedule afresh).
        sched = self.scheduler.schedule(preempt=False)
        if sched is None:
            self.stats.num_ahead_schedules_deferred += 1
            return SchedulerOutput([], [])
        self.stats.num_preemptions += len(sched.preempted)
        return sched

    def _launch_ahead(
        self, st: _Step, sched: SchedulerOutput
    ) -> tuple[SchedulerOutput, Decision | None] | None:
        """Launch ``sched`` before ``st`` is collected if it is a plain step (no drafts) in which every sequence
        that samples in ``st`` decodes one token (its input id: ``st``'s sampled id, gathered on the device)
        and every other sequence computes prompt tokens known on the host (requests joining, prompt chunks):
        a pure decode step, or one in which prompts join the running batch. Returns None when it launched,
        else the batch and the policy's decision for it, for ``_step_after``."""
        decision = self.policy.decide(sched) if self.policy is not None and sched.scheduled else None
        if not sched.scheduled or st.inp.num_logprobs is not None:
            return sched, decision
        if decision is not None and decision.num_speculative_tokens:
            return sched, decision  # speculation starts: its step is built on the real ids
        rows: dict[int, int] = {}
        for s, samples in zip(st.sched.scheduled, st.inp.samples):
            if samples:
                rows[s.seq.seq_id] = len(rows)
        token_rows: list[int] = []  # [T] ModelInput.prev_token_rows
        for s in sched.scheduled:
            row = rows.get(s.seq.seq_id)
            if s.num_draft_tokens:
                return sched, decision
            if row is None:  # prompt tokens: on the host (only sequences sampling in st hold a placeholder)
                token_rows.extend([-1] * s.num_new_tokens)
            elif s.num_new_tokens == 1:
                token_rows.append(row)
            else:
                return sched, decision
        inp = self.build_model_input(sched, decision)
        if len(token_rows) > token_rows.count(-1):  # else every id is on the host (st sampled nothing)
            inp.prev_token_rows = token_rows
        if not self.executor.can_launch(inp):  # type: ignore[attr-defined]
            raise RuntimeError("a plain step scheduled ahead cannot be launched")
        self._inflight = self._start(sched, inp)
        return None

    def _step_after(self, sched: SchedulerOutput, decision: Decision | None) -> list[RequestOutput]:
        """Launch the batch ``_schedule_ahead`` scheduled but could not launch early (with the policy's
        ``decision`` for it), now that the previous step's tokens are applied; sequences that finished with
        that step are dropped from it. Schedules afresh when nothing is left. Returns outputs to emit now (a
        request that cannot run at all)."""
        scheduled = [s for s in sched.scheduled if not s.seq.is_finished]
        if scheduled:
            sched = SchedulerOutput(scheduled, sched.preempted, sched.num_prefills)
            self._inflight = self._start(sched, self.build_model_input(sched, decision))
            return []
        if not self.scheduler.has_unfinished:
            return []
        nxt = self._schedule()
        if isinstance(nxt, list):
            return nxt
        self._inflight = self._start(*nxt)
        return []
