"""The worker side of speculative decoding: target forward -> verification -> drafting, in one call.

Runs on every TP rank next to the target shard (the drafter is co-located, so it reads the target's hidden
states in place). On the general path verification happens on rank 0 and its result is broadcast, so every
rank's drafter sees the same accepted tokens; device-side verification steps (one rank, see
``SpecDecodeWorker``) keep the accepted tokens on the device until the step's single readback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from flexspec.engine.model_input import PLACEHOLDER_TOKEN_ID, ModelInput, ModelOutput
from flexspec.engine.sampler import SamplingMetadata, attach_logprobs, sample
from flexspec.spec.base import DraftProposal, SeqDraftInput
from flexspec.spec.fused_step import FusedVerifyGraphs
from flexspec.spec.registry import build_drafter
from flexspec.spec.step_layout import decode_queries_only, emitting_starts, mixed_layout
from flexspec.spec.tree import emitted_rows, settle_trees
from flexspec.spec.tree_device import settle_trees_on_device
from flexspec.spec.verifier import accept_deterministic_drafts, verify

if TYPE_CHECKING:
    from flexspec.engine.model_runner import ModelRunner

log = logging.getLogger(__name__)


@dataclass
class PendingSpecStep:
    """A launched device-side verification step: its packed result lands in ``rows`` once ``event`` completes.

    ``rows`` [S, K + D + 3] int64 per sequence: the target's tokens at its K + 1 rows, accepted drafts a, the D
    next drafts, how many of them are worth verifying (a drafter with ``device_trees``: D = 2N, the N nodes'
    tokens then parents, and the node count)."""

    inp: ModelInput
    rows: torch.Tensor  # pinned host memory (a view of the worker's readback buffer)
    event: torch.cuda.Event | None  # None on CPU (copied synchronously)
    logits: torch.Tensor  # [N, V] fp32 on the device, one row per logits row (logprobs at collect time)
    starts: list[int]  # [S_emit] first logits row of each emitting sequence
    max_drafts: int  # K: drafts verified by the longest query


class SpecDecodeWorker:
    """Verification + drafting next to one target shard.

    A verification step whose drafts are deterministic and whose drafter drafts on the device
    (``Drafter.proposes_on_device``: DFlash, FlexDraft decoupled) runs *device-side*: target sampling, the
    acceptance test, the drafter's context update and its next block are enqueued back to back, and the host
    reads the result once, also when the step prefills prompt chunks next to the verified queries (chunked
    prefill in a speculative batch).
    ``launch`` enqueues such a step and ``collect`` reads it back, so the engine can overlap the previous step's
    output processing with it, as for plain steps. Other steps verify on the host first, then draft
    (``execute``'s general path). The config's ``device_verification: false`` forces the general path (A/B
    checks and benchmarks).
    """

    def __init__(self, runner: ModelRunner, config) -> None:
        self.runner = runner
        self.config = config
        self.drafter = build_drafter(config, runner)
        self.device_verification: bool = getattr(config, "device_verification", True)
        # (decode-graph query length, tree graph) -> the captured tail of its device-side steps (``capture_fused``)
        self.fused: dict[tuple[int, bool], FusedVerifyGraphs] = {}
        self._readback: torch.Tensor | None = None  # pinned host buffer of a launched step's result
        self.history: dict[int, list[int]] = {}  # seq id -> committed token ids (see token_source)
        # In one process with the engine (TP=1), its token list of a sequence by seq id (None once unknown):
        # launched plain steps then only mark the sequence ``stale`` and its history is taken from the engine
        # when the drafter next reads it (``_commit``), instead of being extended at every plain step.
        self.token_source: Callable[[int], list[int] | None] | None = None
        self.stale: set[int] = set()  # seq ids whose ``history`` misses launched plain steps' tokens
        # seq id -> q [k, V] of its pending drafts, only for drafts sampled from a distribution (absent: none)
        self.pending_probs: dict[int, torch.Tensor] = {}

    def _forget(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            self.history.pop(sid, None)
            self.pending_probs.pop(sid, None)
            self.stale.discard(sid)
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
        """Before the forward of a plain step the runner launches itself (``can_run_plain``): ask for the
        target layers the drafter reads (``observe_plain_step``, after the forward)."""
        if self.drafter.observes_plain_steps:
            inp.capture_layers = self.drafter.capture_layers
            inp.keep_captured = self.drafter.reads_plain_step_captured

    def commit_plain_step(self, inp: ModelInput) -> None:
        """Bookkeeping for a launched plain step, once its forward is enqueued (the device runs meanwhile):
        free finished sequences, extend each history with the step's committed inputs (its sampled token is
        the next step's input, added then) and forget pending draft distributions. With a ``token_source``
        the histories are only marked stale (taken from the engine when next read, ``_commit``): no work per
        sequence, which at batch 64 was ~30 us of every plain step's host time on the CI CPU."""
        self._forget(inp.finished_seq_ids)
        if self.pending_probs:  # only sampled drafts leave distributions (usually none at all)
            for sid in inp.seq_ids:
                self.pending_probs.pop(sid, None)
        if self.token_source is not None:
            if 0 in inp.context_lens:  # a prompt starts (again, after preemption?): as _commit does
                self._forget(
                    [sid for sid, c in zip(inp.seq_ids, inp.context_lens) if self._recomputed(sid, c)]
                )
            self.stale.update(inp.seq_ids)
            return
        history, ids = self.history, inp.input_ids
        r = 0
        for sid, ctx, n in zip(inp.seq_ids, inp.context_lens, inp.query_lens):
            hist = history.get(sid)
            if n == 1 and ctx and hist is not None and len(hist) == ctx:  # a decode step: one token appended
                hist.append(ids[r])
            else:
                self._commit(sid, ctx, ids[r : r + n])
            r += n

    def record_sampled(self, inp: ModelInput, tokens: list[int]) -> None:
        """A launched plain step's sampled ids, once read back (``tokens`` [N], one per emitting sequence):
        where the next step was launched before them (async scheduling), its committed input is a placeholder
        at the sampled position; the history takes the real id."""
        if self.token_source is not None:  # stale histories are taken from the engine's real ids later
            return
        row = 0
        for sid, ctx, n, samples in zip(inp.seq_ids, inp.context_lens, inp.query_lens, inp.samples):
            if not samples:
                continue
            hist = self.history.get(sid)
            pos = ctx + n
            if hist is not None and len(hist) > pos and hist[pos] == PLACEHOLDER_TOKEN_ID:
                hist[pos] = tokens[row]
            row += 1

    def _recomputed(self, sid: int, ctx: int) -> bool:
        """A known sequence computed from position 0 again (preempted, recomputed): its state starts over."""
        return ctx == 0 and (sid in self.history or sid in self.stale)

    def _commit(self, sid: int, ctx: int, committed: list[int]) -> list[int]:
        """Sequence ``sid``'s history cut to its ``ctx`` cached tokens (dropping rejected drafts and anything
        past the cache) plus this step's ``committed`` inputs; returns the history list."""
        if self._recomputed(sid, ctx):
            self._forget([sid])
        if sid in self.stale:  # launched plain steps went by: the engine's tokens up to ctx are all real now
            self.stale.discard(sid)
            source = self.token_source(sid) if self.token_source is not None else None
            if source is not None:
                self.history[sid] = source[:ctx]
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
        fused = self._fused_for(inp) if side is None else None
        if fused is not None:
            return self._collect(self._launch_fused(inp, *fused))
        logits, captured = runner.forward(inp, side=side)
        if side is None and self._runs_on_device(inp):
            return self._collect(self._launch_on_device(inp, logits, captured))

        emit_idx = [s for s, smp in enumerate(inp.samples) if smp]
        num_drafts = [inp.num_draft_tokens[s] for s in emit_idx]
        emitted: list[list[int]] | None = None
        out: ModelOutput | None = None
        if runner.tp.is_first:
            qsl = _cumsum(inp.query_lens)
            drafts = [inp.input_ids[qsl[s + 1] - inp.num_draft_tokens[s] : qsl[s + 1]] for s in emit_idx]
            probs = [self.pending_probs.get(inp.seq_ids[s]) for s in emit_idx]
            meta = SamplingMetadata(inp.sampling_rows, runner.device, inp.num_logprobs)
            trees = [inp.draft_parents[s] for s in emit_idx] if inp.draft_parents is not None else None
            emitted = verify(logits, meta, num_drafts, drafts, probs, trees) if emit_idx else []
            out = ModelOutput(token_ids=emitted)
            if inp.num_logprobs is not None:
                first_rows = _cumsum([d + 1 for d in num_drafts])[:-1]
                rows = emitted_rows(first_rows, emitted, drafts, trees)
                attach_logprobs(out, logits, first_rows, inp.num_logprobs, rows)
        emitted = runner.tp.broadcast_object(emitted)  # type: ignore[assignment]
        assert emitted is not None
        paths = self._settle_trees(inp, emitted) if inp.draft_parents is not None else None

        batch = self._draft_inputs(inp, emitted, paths)
        if inp.num_speculative_tokens == 0 and not self.drafter.observes_every_step:
            proposal = DraftProposal(token_ids=[[] for _ in batch])  # a plain step: nothing to draft
        else:
            proposal = self.drafter.propose(batch, captured)
        for s in emit_idx:
            q = proposal.draft_probs[s] if proposal.draft_probs else None
            if q is None:
                self.pending_probs.pop(inp.seq_ids[s], None)
            else:
                self.pending_probs[inp.seq_ids[s]] = q
        if out is not None:
            out.draft_token_ids = [list(proposal.token_ids[s]) for s in emit_idx]
            if proposal.parents and any(p is not None for p in proposal.parents):
                out.draft_parents = [proposal.parents[s] for s in emit_idx]
        return out

    def _settle_trees(self, inp: ModelInput, emitted: list[list[int]]) -> list[list[int] | None]:
        """After verifying draft trees (every rank, from the broadcast tokens): move the accepted nodes' K/V (and
        feature-cache rows) to the slots of their positions, so the cache holds the accepted path as a chain.
        Returns [S] the accepted node indices per sequence (None: a chain or no emission)."""
        paths, src, dst = settle_trees(inp, emitted)
        if src:
            self.runner.move_kv(src, dst)
        return paths

    def _runs_on_device(self, inp: ModelInput) -> bool:
        """Whether this step can verify and draft without a host sync in between: one rank, a drafter that
        drafts deterministically on the device, and either every sequence an emitting query ``[last token,
        drafts...]`` (no drafts is fine: the first step of speculation) with logits on every row (checked
        first: no per-token work), or such queries next to prompt chunks (``mixed_layout``). A
        step that verifies drafts but proposes none (the policy switching to plain decoding) runs here too:
        the drafter then only updates its state (``propose_on_device`` with ``num_speculative_tokens == 0``), or,
        with a captured tail (``_fused_for``), the tail runs whole and its drafts are dropped."""
        if not self._device_capable(inp):
            return False
        if decode_queries_only(inp):
            return True
        return inp.spec_mode != "parallel" and inp.draft_parents is None and mixed_layout(inp)

    def _device_capable(self, inp: ModelInput) -> bool:
        """``_runs_on_device``'s conditions other than the step's layout: device verification on, a drafter that
        drafts on the device, one rank, and no sequence with a proposal distribution pending."""
        return bool(
            self.device_verification
            and self.drafter.proposes_on_device
            and self.runner.tp.size == 1
            and inp.seq_ids
            # draft trees: on the device where the drafter builds them there; logprobs: the general path
            and (inp.draft_parents is None or (self.drafter.device_trees and inp.num_logprobs is None))
            and not (self.pending_probs and any(sid in self.pending_probs for sid in inp.seq_ids))
        )

    def can_launch(self, inp: ModelInput) -> bool:
        """Whether ``inp`` is a verification step that ``launch`` can enqueue and ``collect`` finish later
        (a device-side step that is not FlexDraft's parallel mode)."""
        return inp.spec_mode != "parallel" and self._runs_on_device(inp)

    @torch.inference_mode()
    def launch(self, inp: ModelInput) -> PendingSpecStep:
        """Enqueue a device-side verification step (``can_launch``) without waiting for the device."""
        self._forget(inp.finished_seq_ids)
        inp.capture_layers = self.drafter.capture_layers
        side = self.drafter.begin_step(inp)
        assert side is None, "a launched verification step carries no side stream"
        fused = self._fused_for(inp)
        if fused is not None:
            return self._launch_fused(inp, *fused)
        logits, captured = self.runner.forward(inp)
        return self._launch_on_device(inp, logits, captured)

    def capture_fused(self, graphs: list, capture: bool = True) -> None:
        """Build the captured tails of device-side steps (``FusedVerifyGraphs``) for the runner's decode graphs
        that capture the drafter's layers, when the drafter has one (``fused_tail``) and the config allows it.
        A tail that fails to capture leaves that query length on the eager device-side path.
        ``capture=False`` builds them uncaptured (eager replays of the same tail: CPU tests)."""
        if not (
            getattr(self.config, "fused_verification_graphs", True)
            and self.device_verification
            and self.drafter.proposes_on_device
            and hasattr(self.drafter, "fused_tail")
            and self.runner.tp.size == 1
        ):
            return
        pool = graphs[0].pool if graphs else None  # replayed one after another: one pool
        layers = tuple(self.drafter.capture_layers)
        for decode in sorted(graphs, key=lambda g: -g.q):  # largest first: one pool
            if decode.capture_layers != layers or (decode.tree and not self.drafter.device_trees):
                continue
            try:
                tail = FusedVerifyGraphs(decode, self.drafter, pool=pool, capture=capture)
            except Exception as e:  # noqa: BLE001 - the eager device-side path stays correct
                log.warning("fused verification graphs (query length %d) not captured (%s)", decode.q, e)
                continue
            pool = tail.pool
            self.fused[decode.q, decode.tree] = tail

    def _fused_for(self, inp: ModelInput):
        """(decode graphs, fused tail) for a device-side step that fits them, else None: every sequence a decode
        query ``[last token, drafts...]`` that emits, all rows greedy, no logprobs, drafts proposed or verified,
        and the decode graph the runner would replay (the first that fits) has a captured tail. The step that
        switches to plain decoding (it verifies drafts, proposes none) replays the tail too and drops its drafts
        (``_collect`` keeps none when ``num_speculative_tokens`` is 0): on the eager path it took 3.6-4.8 ms at
        b=64 against a fused step's ~3.3 (H100, session 30)."""
        if not self.fused or inp.spec_mode == "parallel":
            return None
        if inp.num_speculative_tokens == 0 and not any(inp.num_draft_tokens):
            return None  # a plain step (the runner's own path)
        if inp.num_logprobs is not None or inp.prev_token_rows is not None:
            return None
        if not decode_queries_only(inp) or not self._device_capable(inp):  # = _runs_on_device, layout once
            return None
        if any(row[0] != 0.0 for row in inp.sampling_rows):
            return None
        decode = next((g for g in self.runner.graphs if g.can_run(inp)), None)
        tail = self.fused.get((decode.q, decode.tree)) if decode is not None else None
        if tail is None or tail.decode is not decode or not tail.can_run(inp):
            return None
        return decode, tail

    def _launch_fused(self, inp: ModelInput, decode, tail: FusedVerifyGraphs) -> PendingSpecStep:
        """A device-side step as two graph replays (``FusedVerifyGraphs``): the target's verification forward,
        then the acceptance test + drafter tail. Same result as ``_launch_on_device``."""
        if 0 in inp.context_lens:  # as _launch_on_device: a recomputed prompt's drafter state starts over
            self._forget([sid for sid, c in zip(inp.seq_ids, inp.context_lens) if self._recomputed(sid, c)])
        drafter = self.drafter
        meta_rows, tables, held = drafter.plan_device_step(inp)
        drafter.write_held_context(held)  # positions left by plain steps, from the feature cache
        bs, _ = decode.replay(inp)
        packed = tail.run(inp, bs, meta_rows, tables)  # [S, q + 2 + D]
        return self._read_back(inp, packed, decode.logits[bs], [], decode.q - 1)

    def _launch_on_device(
        self, inp: ModelInput, logits: torch.Tensor, captured: list[torch.Tensor]
    ) -> PendingSpecStep:
        """Device-side verification step (see the class docstring). ``logits`` [N, V]: one row per logits row
        (every row of a decode query, the last row of a prompt chunk that ends its prompt).

        Same result as the general path: target tokens come from the plain sampler, drafts are accepted iff
        equal to them (``accept_deterministic_drafts``; draft trees: ``accept_tree_drafts``, then the accepted
        nodes' K/V move to their positions' slots), and the drafter sees the same committed tokens. The
        step's only host sync is ``collect``'s wait for the readback of emitted tokens and next drafts (+ the
        logprobs when asked)."""
        runner = self.runner
        # A prompt computed from position 0 again (preempted): as the general path's ``_commit`` does before
        # drafting, its drafter state starts over before this step's context is written.
        if 0 in inp.context_lens:
            self._forget([sid for sid, c in zip(inp.seq_ids, inp.context_lens) if self._recomputed(sid, c)])
        S, K = len(inp.seq_ids), max(inp.num_draft_tokens)
        starts = emitting_starts(inp)
        qsl = _cumsum(inp.query_lens)
        drafts = [0] * (S * K)
        for s, d in enumerate(inp.num_draft_tokens):
            if d:
                drafts[s * K : s * K + d] = inp.input_ids[qsl[s + 1] - d : qsl[s + 1]]
        host = torch.tensor([*starts, *inp.num_draft_tokens, *drafts], dtype=torch.int64)
        dev = host.to(runner.device, non_blocking=True)
        starts_t, num_drafts_t, drafts_t = dev[:S], dev[S : 2 * S], dev[2 * S :].view(S, K)
        meta = SamplingMetadata(inp.sampling_rows, runner.device, inp.num_logprobs)
        target = sample(logits, meta)  # [T]
        if inp.draft_parents is None:
            tokens, accepted = accept_deterministic_drafts(target, starts_t, num_drafts_t, drafts_t)
            next_drafts, keep = self.drafter.propose_on_device(inp, tokens, accepted, captured)
        else:  # trees (decode queries only: logits rows = input rows)
            tokens, accepted, path = self._accept_trees(inp, target, starts_t, num_drafts_t, drafts_t)
            next_drafts, keep = self.drafter.propose_on_device(inp, tokens, accepted, captured, path=path)
        packed = torch.cat([tokens, accepted[:, None], next_drafts, keep[:, None]], 1)  # [S, K + D + 3]
        starts = [r for r, emits in zip(starts, inp.samples) if emits]
        return self._read_back(inp, packed, logits, starts, K)

    def _accept_trees(self, inp, target, starts, num_drafts, drafts):
        """``settle_trees_on_device`` (a hook for tests)."""
        return settle_trees_on_device(self.runner, inp, target, starts, num_drafts, drafts)

    def _read_back(
        self, inp: ModelInput, packed: torch.Tensor, logits: torch.Tensor, starts: list[int], K: int
    ) -> PendingSpecStep:
        """Copy a device-side step's packed result [S, K + D + 3] to pinned host memory behind an event."""
        n = packed.numel()
        cuda = self.runner.device.type == "cuda"
        if self._readback is None or self._readback.numel() < n:
            self._readback = torch.empty(max(n, 4096), dtype=torch.int64, pin_memory=cuda)
        rows_host = self._readback[:n].view(packed.shape)
        rows_host.copy_(packed, non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        return PendingSpecStep(inp, rows_host, event, logits, starts, K)

    def collect(self, pending: PendingSpecStep) -> ModelOutput:
        """Wait for a launched verification step; emitted tokens, next drafts and the worker's bookkeeping."""
        return self._collect(pending)

    def _collect(self, pending: PendingSpecStep) -> ModelOutput:
        if pending.event is not None:
            pending.event.synchronize()
        inp, K = pending.inp, pending.max_drafts
        rows = pending.rows.tolist()
        if not all(inp.samples):  # prompt chunks that do not end their prompt emit nothing
            rows = [row for row, emits in zip(rows, inp.samples) if emits]
        emitted = [row[: row[K + 1] + 1] for row in rows]
        out = ModelOutput(token_ids=emitted)
        if inp.num_logprobs is not None:
            attach_logprobs(out, pending.logits, pending.starts, inp.num_logprobs)
        if self.token_source is not None:
            wanted = self._mark_device_step(inp, emitted)
        else:  # the same history bookkeeping as the general path
            wanted = [b.num_drafts for b in self._draft_inputs(inp, emitted) if b.emitted]
        k = self.drafter.num_speculative_tokens
        if self.drafter.device_trees:
            out.draft_token_ids, parents = self.drafter.device_tree_drafts(rows, K, wanted)
            if any(p is not None for p in parents):
                out.draft_parents = parents
        else:
            cut = not inp.verify_all_drafts  # to row[-1], the confident prefix (selective verification)
            out.draft_token_ids = [
                row[K + 2 : K + 2 + min(w, k, row[-1] if cut else k)] for w, row in zip(wanted, rows)
            ]
        if self.pending_probs:  # deterministic drafts: no distributions pending
            for sid in inp.seq_ids:
                self.pending_probs.pop(sid, None)
        return out

    def _mark_device_step(self, inp: ModelInput, emitted: list[list[int]]) -> list[int]:
        """A device-side step's bookkeeping with a ``token_source``: as for launched plain steps, the histories
        are only marked stale (the engine's token lists hold the committed tokens; ``_commit`` takes them when a
        host-verified step next reads one), and the drafts wanted next are counted from the query layout
        (``_draft_inputs``' rule: up to ``num_speculative_tokens``, within the room left before ``max_lens``).
        Returns them per emitting sequence. At batch 64 ``_draft_inputs`` built ~64 histories and draft inputs
        that this path never reads (~1 ms per step on the CI CPU, under a line profiler)."""
        self.stale.update(inp.seq_ids)
        wanted: list[int] = []
        k, n_spec = 0, inp.num_speculative_tokens
        for ctx, q, d, emits, max_len in zip(
            inp.context_lens, inp.query_lens, inp.num_draft_tokens, inp.samples, inp.max_lens
        ):
            if emits:  # history: ctx cached + the query less its drafts + the accepted drafts and bonus
                length = ctx + q - d + len(emitted[k])
                k += 1
                wanted.append(max(0, min(n_spec, max_len - length - 1)))
        return wanted

    def _draft_inputs(
        self, inp: ModelInput, emitted: list[list[int]], paths: list[list[int] | None] | None = None
    ) -> list[SeqDraftInput]:
        """``paths`` [S]: the accepted nodes of verified draft trees (``_settle_trees``; None: chains)."""
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
            hidden_rows = list(range(qsl[s], qsl[s] + num_committed))
            path = paths[s] if paths is not None else None
            if path:  # the accepted tree nodes' rows follow the query's committed rows
                first = qsl[s + 1] - d
                hidden_rows[first - qsl[s] :] = [first + node for node in path]
            batch.append(
                SeqDraftInput(
                    seq_id=sid,
                    token_ids=hist,
                    num_new_committed=num_committed,
                    hidden_rows=hidden_rows,
                    num_drafts=num_drafts,
                    temperature=temperature,
                    seed=seed,
                    emitted=inp.samples[s],
                    block_table=inp.block_tables[s],
                )
            )
        return batch


def _cumsum(xs: list[int]) -> list[int]:
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out
