"""LLMEngine: requests in, token/text deltas out. Owns the tokenizer, scheduler and executor."""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass
from typing import Any

from configs.engine import EngineConfig
from configs.sampling import SamplingParams
from flexspec.engine.async_scheduling import AsyncSchedulingMixin
from flexspec.engine.block_manager import BlockManager
from flexspec.engine.detokenizer import IncrementalDetokenizer, find_stop
from flexspec.engine.executor import Executor, LocalExecutor
from flexspec.engine.input_builder import general_input, plain_decode_input, verify_decode_input
from flexspec.engine.model_input import ModelInput, ModelOutput
from flexspec.engine.outputs import RequestOutput
from flexspec.engine.prompts import PromptMixin
from flexspec.engine.scheduler import Scheduler, SchedulerOutput
from flexspec.engine.sequence import Sequence, SequenceStatus, TokenLogprob
from flexspec.errors import ContextLengthExceededError, InvalidRequestError
from flexspec.models.spec import ModelSpec
from flexspec.spec.metrics import SpecDecodingMetrics
from flexspec.spec.policy import Decision, SpeculationPolicy
from flexspec.spec.warmup import profile_speculation

FINISHED = SequenceStatus.FINISHED


@dataclass
class EngineStats:
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0
    num_preemptions: int = 0
    # steps scheduled after the previous step's result because scheduling ahead would have preempted
    num_ahead_schedules_deferred: int = 0


@dataclass
class _Step:
    """A scheduled step: launched (``pending``, collected later) or already executed (``output``)."""

    sched: SchedulerOutput
    inp: ModelInput
    t0: float
    pending: Any = None
    output: ModelOutput | None = None
    # Async scheduling: the step's tokens were provisionally applied before it was collected (placeholder ids
    # appended, computed tokens advanced) except for the sequences in ``held_out`` (ids), which finish with it.
    provisional: bool = False
    held_out: frozenset[int] = frozenset()
    # The policy's decision before this step's (its timing counts only in a mode's steady state). Kept here
    # because with async scheduling the next step is decided before this one is observed.
    prev_mode: str | None = None
    option: str = "plain"  # the policy's option for this step (Decision.option: "decoupled/3", ...)


@dataclass
class _Appended:
    """Tokens a step appended to one sequence, waiting for ``LLMEngine._emit``."""

    seq: Sequence
    detok: IncrementalDetokenizer
    new_ids: list[int]
    new_lps: list[TokenLogprob]
    text_done: bool  # decoded already (requests with stop strings)
    stopped_by_token: bool = False  # the last id is EOS / a stop token id: kept in ids, not in text (vLLM)


class LLMEngine(AsyncSchedulingMixin, PromptMixin):
    """Continuous-batching generation engine.

    Usage: ``add_request`` any number of requests, then call ``step`` until ``has_unfinished`` is False;
    each step returns one ``RequestOutput`` per request that produced tokens or finished.
    """

    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        from transformers import AutoTokenizer

        self.config = config
        self.executor = executor or LocalExecutor(config)
        self.tokenizer = AutoTokenizer.from_pretrained(
            config.tokenizer or self.executor.model_dir, trust_remote_code=config.trust_remote_code
        )
        self.spec: ModelSpec = self.executor.spec
        self.eos_token_ids = set(self.spec.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.block_manager = BlockManager(self.executor.num_kv_blocks, config.kv_block_size)
        self.scheduler = Scheduler(config, self.block_manager)
        self.seqs: dict[str, Sequence] = {}
        self._seqs_by_id: dict[int, Sequence] = {}  # until the executor is told the sequence finished
        self.detok: dict[str, IncrementalDetokenizer] = {}
        self.stats = EngineStats()
        self._rng = random.Random(config.seed)
        self.spec_metrics = SpecDecodingMetrics()
        self.policy = SpeculationPolicy(config) if config.speculative_config is not None else None
        worker = getattr(getattr(self.executor, "runner", None), "spec_worker", None)
        if worker is not None:  # in-process drafter: it reads our token lists instead of keeping copies
            worker.token_source = self._token_ids_of
            if self.policy is not None:  # a draft tree of 62 nodes accepts at most a block's depth per step
                self.policy.max_chain_drafts = min(
                    self.policy.max_chain_drafts, worker.drafter.max_chain_drafts
                )
        self._finished_seq_ids: list[int] = []
        self.last_mode = "plain"  # execution mode the policy chose for the latest step
        self.last_step_seconds = 0.0
        self._ids = itertools.count()
        self._inflight: _Step | None = None  # a launched step whose output is not processed yet
        self._busy = 0.0  # seconds inside step() since the latest step result (policy timing)
        self._mark = 0.0
        self.speculation_profile: dict[str, float] = {}  # "mode@bucket" -> median step ms (warm-up profile)
        steps = config.speculation_profile_steps
        if steps is None:
            steps = 8 if getattr(self.executor, "device_type", "cpu") == "cuda" else 0
        if steps and self.policy is not None and self.policy.spec.execution == "auto":
            self.speculation_profile = self.profile_speculation(steps)

    # ---- requests -----------------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request. ``prompt`` is text (tokenized with special tokens) or token ids.

        Raises:
            InvalidRequestError: empty prompt, token ids out of vocabulary, duplicate request id.
            ContextLengthExceededError: the prompt leaves no room for one output token.
        """
        params = params or SamplingParams()
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids or (isinstance(prompt, str) and not prompt):
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if any(not 0 <= t < self.spec.vocab_size for t in ids):
            raise InvalidRequestError("prompt token ids out of vocabulary range", param="prompt")
        if len(ids) >= self.config.max_model_len:
            raise ContextLengthExceededError(
                f"prompt has {len(ids)} tokens; max_model_len is {self.config.max_model_len} "
                "(prompt + at least one output token must fit)",
                param="prompt",
            )
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.seqs:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        seq = Sequence(
            request_id,
            ids,
            params,
            seed=self._rng.getrandbits(62),
            max_model_len=self.config.max_model_len,
            eos_token_ids=self.eos_token_ids,
        )
        self.seqs[request_id] = seq
        self._seqs_by_id[seq.seq_id] = seq
        self.detok[request_id] = IncrementalDetokenizer(self.tokenizer, ids)
        self.scheduler.add(seq)
        self.stats.num_prompt_tokens += len(ids)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks (no-op if unknown or finished)."""
        seq = self.seqs.pop(request_id, None)
        self.detok.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq, "abort")
            self._finished_seq_ids.append(seq.seq_id)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self._inflight is not None

    # ---- one step -----------------------------------------------------------------------------------------
    def build_model_input(self, sched: SchedulerOutput, decision: Decision | None = None) -> ModelInput:
        """The step's flattened input; ``decision`` is the speculation policy's for this batch (decided here
        when not given)."""
        bs = self.config.kv_block_size
        scheduled = sched.scheduled
        if all(s.num_new_tokens == 1 and s.num_draft_tokens == 0 for s in scheduled):
            inp = plain_decode_input(scheduled, bs)
        else:
            # a step where prompts join is no verification batch: not tried (it would stop at the first prompt)
            fast = None if sched.num_prefills else verify_decode_input(scheduled, bs)
            inp = fast or general_input(scheduled, bs)
        if self.policy is not None:
            decision = decision or self.policy.decide(sched)
            inp.num_speculative_tokens = decision.num_speculative_tokens
            inp.spec_mode = decision.mode
            inp.verify_all_drafts = self.policy.forced_full_drafts  # warm-up profile (flexspec.spec.warmup)
        inp.finished_seq_ids, self._finished_seq_ids = self._finished_seq_ids, []
        for sid in inp.finished_seq_ids:
            self._seqs_by_id.pop(sid, None)
        return inp

    def _token_ids_of(self, seq_id: int) -> list[int] | None:
        """A running sequence's token list (prompt + output; the in-process drafter's ``token_source``)."""
        seq = self._seqs_by_id.get(seq_id)
        return seq.token_ids if seq is not None else None

    def _schedule(self) -> tuple[SchedulerOutput, ModelInput] | list[RequestOutput]:
        """Schedule the next step; returns its batch and input, or the outputs to return when nothing runs."""
        sched = self.scheduler.schedule()
        self.stats.num_preemptions += len(sched.preempted)
        if not sched.scheduled:
            if self.scheduler.waiting and not self.scheduler.running:
                seq = self.scheduler.waiting[0]  # cannot fit even alone: fail it rather than spin
                self.scheduler.finish(seq, "abort")
                return [self._output(seq, [], "", [])]
            return []
        return sched, self.build_model_input(sched)

    @property
    def overlaps_output_processing(self) -> bool:
        """Whether ``step`` starts the next step before processing the last one's outputs (plain steps are then
        launched without waiting; speculative steps still run synchronously)."""
        return self.config.async_output_processing and hasattr(self.executor, "launch")

    def _start(self, sched: SchedulerOutput, inp: ModelInput) -> _Step:
        t0 = time.perf_counter()
        ex: Any = self.executor
        modes = self.policy.last_modes if self.policy is not None else []
        prev = modes[0] if len(modes) == 2 else None  # modes[-1] is this step's decision
        option = modes[-1] if modes else inp.spec_mode
        if self.overlaps_output_processing and ex.can_launch(inp):
            return _Step(sched, inp, t0, pending=ex.launch(inp), prev_mode=prev, option=option)
        return _Step(sched, inp, t0, output=ex.execute(inp), prev_mode=prev, option=option)

    def step(self) -> list[RequestOutput]:
        """Run one step and return the outputs of the step that completed.

        With ``async_output_processing`` (one process) the engine overlaps: it waits for the step started by
        the previous call, applies its tokens (stop conditions, KV accounting), starts the next step, and
        detokenizes / builds outputs while the device runs it. Plain steps are launched without waiting;
        speculative steps (and plain ones whose drafter must see every step) run synchronously at that point.
        Stop strings are still checked before the next step is scheduled, so no sequence runs past its stop;
        except with async scheduling (``schedules_ahead``), where a plain step (decodes, and prompts joining
        them) is launched before the previous one's tokens are read back and a sequence that stops on EOS / a
        stop token / a stop string computes one token more, which is dropped.
        """
        self._mark = time.perf_counter()
        try:
            return self._step()
        finally:
            self._busy += time.perf_counter() - self._mark

    def _step(self) -> list[RequestOutput]:
        if self._inflight is None:
            nxt = self._schedule()
            if isinstance(nxt, list):
                return nxt
            self._inflight = self._start(*nxt)
        st, self._inflight = self._inflight, None
        ahead: tuple[SchedulerOutput, Decision | None] | None = None
        if st.pending is not None and self._is_plain(st.inp) and self.schedules_ahead:
            ahead = self._launch_ahead(st, self._schedule_ahead(st))  # None: launched
        out = st.output if st.output is not None else self.executor.collect(st.pending)  # type: ignore[attr-defined]
        done = time.perf_counter()
        self.last_step_seconds = done - st.t0
        # The policy compares modes by the engine time between two steps' results (scheduling, launch, output
        # processing and the wait), which is what throughput pays, overlapped or not; time the caller spends
        # between step() calls is not counted.
        period = self._busy + (done - self._mark)
        self._busy, self._mark = 0.0, done
        self.stats.num_steps += 1
        sched, inp = st.sched, st.inp
        self.last_mode = inp.spec_mode if self.policy is not None else "plain"  # of the step returned now
        step_metrics = SpecDecodingMetrics()
        appended: list[_Appended] = []
        unverified: list[Sequence] = []  # emitting requests whose drafts were not verified this step
        verified_length = 0  # the most drafts the verified requests were allowed (their policy option's)
        policy = self.policy
        plain = not inp.num_speculative_tokens
        provisional, held_out = st.provisional, st.held_out
        token_rows, lps_rows, tops_rows = out.token_ids, out.logprobs, out.top_logprobs
        draft_rows, parent_rows = out.draft_token_ids, out.draft_parents
        i = 0
        # inp.samples: as scheduled. Never recompute it from the sequence here: an abort while the step was in
        # flight resets the sequence (its row must still be consumed, or later rows shift onto other requests).
        for s, samples in zip(sched.scheduled, inp.samples):
            seq = s.seq
            if not samples:
                if seq.status is not FINISHED and not provisional:
                    seq.num_computed_tokens += s.num_new_tokens
                continue
            tokens = token_rows[i]
            drafts = draft_rows[i] if draft_rows is not None else []
            parents = parent_rows[i] if parent_rows is not None else None
            lps = None
            if lps_rows is not None and seq.params.logprobs is not None:
                k, tops = seq.params.logprobs, tops_rows[i]  # type: ignore[index]
                lps = [TokenLogprob(t, lp, top[:k]) for t, lp, top in zip(tokens, lps_rows[i], tops)]
            i += 1
            if seq.status is FINISHED:  # aborted while its step was in flight
                continue
            d = s.num_draft_tokens
            accepted = len(tokens) - 1
            if accepted > d:
                raise RuntimeError(f"executor emitted {len(tokens)} tokens for {d} drafts")
            if d:
                step_metrics.observe(d, accepted)
            if policy is not None:
                if d:
                    policy.observe_request(seq, d, accepted, seq.draft_length)
                    verified_length = max(verified_length, seq.draft_length)
                elif plain:
                    # aged in one call below (every row of a plain step); a step that starts drafting for the
                    # request (entering speculation) is no plain step and does not age its estimate
                    unverified.append(seq)
            if provisional and seq.seq_id not in held_out:
                seq.token_ids.pop()  # the placeholder (computed tokens were advanced by _schedule_ahead)
            else:
                # K/V of rejected drafts stay in the cache but are overwritten: only accepted positions count.
                seq.num_computed_tokens += s.num_new_tokens - d + accepted
            appended.append(self._append_ids(seq, tokens, lps))
            finished = seq.status is FINISHED
            seq.draft_token_ids = [] if finished else list(drafts)
            seq.draft_length = inp.num_speculative_tokens
            seq.draft_parents = None if finished or not drafts else parents
            if not finished and seq.seq_id in held_out:
                raise RuntimeError(f"request {seq.request_id} was held out of scheduling but did not finish")
        if i != len(out.token_ids):
            raise RuntimeError(f"step returned {len(out.token_ids)} token rows for {i} sampling sequences")
        if unverified:
            self.policy.age_requests(unverified)  # type: ignore[union-attr]
        self.spec_metrics.merge(step_metrics)
        if self.policy is not None and all(inp.samples):
            # A step that also prefills a prompt costs what its prompt costs (eager, 10-20x a decode step on
            # the H200): timed apart from the mode's decode steps (recorded as the mode's time, it locked that
            # mode out of batches with request turnover), as its join-step time (policy.mean_step_time).
            scheduled = sched.scheduled  # one token each and no drafts: a pure decode step without a loop
            decode = (len(inp.input_ids) == len(scheduled) and not any(inp.num_draft_tokens)) or all(
                s.num_new_tokens == 1 + s.num_draft_tokens for s in scheduled
            )
            self.policy.observe(
                st.option,
                len(sched.scheduled),
                period,
                step_metrics.per_position_acceptance,
                previous=st.prev_mode,
                verified_length=verified_length or None,
                prefill=not decode,
            )
        early: list[RequestOutput] = []
        if ahead is not None:
            early = self._step_after(*ahead)
        elif st.provisional:
            pass  # the next step is in flight already
        elif self.overlaps_output_processing and self.scheduler.has_unfinished:
            nxt = self._schedule()
            if isinstance(nxt, list):
                early = nxt
            else:
                self._inflight = self._start(*nxt)
        return [self._emit(a) for a in appended] + early

    def _append_ids(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None) -> _Appended:
        """Append sampled/accepted tokens one by one, stopping exactly at EOS, a stop token, a stop string,
        ``max_tokens`` or ``max_model_len``; tokens after the stop point are dropped. Text is decoded here only
        for requests with stop strings (they need it to stop); the others decode in ``_emit``."""
        p = seq.params
        detok = self.detok[seq.request_id]
        token_ids = seq.token_ids
        with_text = bool(p.stop)
        if (  # the common case: no stop strings or logprobs, and none of the tokens ends the request
            not with_text
            and logprobs is None
            and len(token_ids) + len(tokens) < seq.max_len
            and seq.stop_token_set.isdisjoint(tokens)
        ):
            token_ids.extend(tokens)
            self.stats.num_generation_tokens += len(tokens)
            return _Appended(seq, detok, list(tokens), [], False)
        new_ids: list[int] = []
        new_lps: list[TokenLogprob] = []
        reason: str | None = None
        stopped_by_token = False
        for i, tok in enumerate(tokens):
            token_ids.append(tok)
            new_ids.append(tok)
            if logprobs is not None:
                new_lps.append(logprobs[i])
                seq.logprobs.append(logprobs[i])
            if tok in seq.stop_token_set:
                reason, stopped_by_token = "stop", True
                if tok in p.stop_token_ids and tok not in seq.eos_token_ids:  # EOS: no stop reason (vLLM)
                    seq.stop_reason = tok
            if with_text and reason is None:  # a stop token's own text is not part of the output (vLLM)
                delta = detok.add(tok)
                cut = find_stop(detok.text, len(delta), p.stop)
                if cut is not None:
                    seq.stop_reason = min((s for s in p.stop if detok.text.startswith(s, cut)), key=len)
                    detok.text = detok.text[:cut]
                    reason = "stop"
            if reason is None and len(token_ids) >= seq.max_len:  # max_tokens or max_model_len
                reason = "length"
            if reason is not None:
                break
        self.stats.num_generation_tokens += len(new_ids)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self._finished_seq_ids.append(seq.seq_id)
            self.seqs.pop(seq.request_id, None)
        return _Appended(seq, detok, new_ids, new_lps, with_text, stopped_by_token)

    def _emit(self, a: _Appended) -> RequestOutput:
        """Detokenize what ``_append_ids`` left and build the request's output."""
        seq = a.seq
        detok = a.detok
        if not a.text_done:
            for tok in a.new_ids[:-1] if a.stopped_by_token else a.new_ids:
                detok.add(tok)
        text = seq.output_text = detok.text
        finished = seq.status is FINISHED
        if finished:
            self.detok.pop(seq.request_id, None)
        # Stream only text that can no longer become the start of a stop string.
        sent = seq.num_text_sent
        end = max(sent, len(text) - (0 if finished else seq.stop_text_hold))
        seq.num_text_sent = end
        return RequestOutput(
            seq.request_id,
            seq.prompt_token_ids,
            None,
            text,
            a.new_ids,
            text[sent:end],
            a.new_lps,
            finished,
            seq.finish_reason,
            seq.stop_reason,
            # sliced when read: the token list only grows past len(seq) (RequestOutput's docstring)
            token_source=(seq.token_ids, seq.num_prompt_tokens, len(seq.token_ids)),
        )

    def _output(
        self, seq: Sequence, new_ids: list[int], new_text: str, lps: list[TokenLogprob]
    ) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            # sliced when read: the token list only grows past len(seq) (RequestOutput's docstring)
            token_source=(seq.token_ids, seq.num_prompt_tokens, len(seq)),
            text=seq.output_text,
            new_token_ids=new_ids,
            new_text=new_text,
            new_logprobs=lps,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )

    # ---- offline convenience ------------------------------------------------------------------------------
    def generate(
        self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run prompts to completion as one continuous batch; outputs in prompt order."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished:
            for o in self.step():
                if o.finished:
                    final[o.request_id] = o
        return [final[i] for i in ids]

    def profile_speculation(self, steps_per_mode: int, max_batch_size: int | None = None) -> dict[str, float]:
        """The policy's warm-up profile: see :func:`flexspec.spec.warmup.profile_speculation`."""
        return profile_speculation(self, steps_per_mode, max_batch_size)

    def shutdown(self) -> None:
        self.executor.shutdown()
