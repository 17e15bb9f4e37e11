"""The drafter interface every speculative method implements.

Terms (DESIGN.md section 3): *draft tokens* are proposed by the drafter; the target verifies them in one
forward; the *accepted length* a is the number that pass; the *bonus token* is the target's own token after
the last accepted draft (always emitted), so one step emits a + 1 tokens.

A drafter lives in the worker, next to its target shard (same process, same TP rank), so it can read the
target's hidden states and KV cache without copies. Each step, after verification, the worker calls
``propose`` once with what the step committed; drafts come back to the engine with the emitted tokens and
are verified in the next step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from flexspec.engine.model_runner import ModelRunner


@dataclass
class SeqDraftInput:
    """One sequence's view of the step that just ran.

    ``token_ids`` is the committed history (prompt + emitted tokens). Its last ``num_new_committed + 1``
    tokens are new this step: the first ``num_new_committed`` of those went through the target forward
    (their hidden states are ``hidden_rows`` of the captured layers), the very last one (the bonus or
    recovered token) has not been through the target yet. For a prefill chunk that does not reach the end of
    the prompt, nothing is emitted: ``num_drafts`` is 0 and only the hidden states are new.
    """

    seq_id: int
    token_ids: list[int]  # committed history
    num_new_committed: int  # tokens whose target hidden states are new this step
    hidden_rows: list[int]  # [num_new_committed] rows into the captured hidden states [T, H]
    num_drafts: int  # drafts wanted for the next step (0 = only observe)
    temperature: float  # request temperature (probabilistic drafters may sample)
    seed: int  # request seed: drafters that sample derive their noise from (seed, position)
    emitted: bool  # True when the step emitted tokens for this sequence (last token is new, not computed)
    block_table: list[int] = field(default_factory=list)  # the target's KV blocks of the sequence


@dataclass
class DraftProposal:
    """Drafts for the next step. ``draft_probs`` is None for deterministic drafts (argmax / lookup)."""

    token_ids: list[list[int]]  # [S][k_s]
    draft_probs: list[torch.Tensor | None] = field(default_factory=list)  # [S] of [k_s, V] fp32 or None
    # [S] each sequence's draft tree (``flexspec.spec.tree``: parents [k_s]; None = a chain); empty = all chains.
    # Trees are for deterministic drafts only (``draft_probs`` None).
    parents: list[list[int] | None] = field(default_factory=list)


class Drafter(ABC):
    """Base class: proposes up to ``num_speculative_tokens`` drafts per sequence per step."""

    method: ClassVar[str]
    # False when a step that asks for no drafts needs nothing from the drafter (its state is the committed
    # token history only, which the worker keeps): such steps skip ``propose``. Drafters that feed on every
    # step's target hidden states (DFlash's context K/V, EAGLE-3, MTP) or keep their own KV cache stay True.
    observes_every_step: ClassVar[bool] = True
    # True when ``observe_plain_step`` keeps the drafter's per-step state up to date without a host sync, so
    # the runner may launch plain steps itself (async output processing) although ``observes_every_step``.
    observes_plain_steps: ClassVar[bool] = False
    # True when ``propose_on_device`` drafts from device tensors without a host sync (deterministic drafts),
    # so the worker may verify and draft in one device-side step.
    proposes_on_device: ClassVar[bool] = False
    # True when ``propose_on_device`` proposes draft trees: its drafts are [S, 2N] (node tokens, then parents,
    # ``flexspec.spec.tree``) and its keep counts nodes; it then also takes the accepted ``path`` of verified trees.
    device_trees: ClassVar[bool] = False

    def __init__(self, config, runner: ModelRunner) -> None:
        self.config = config
        self.runner = runner
        self.num_speculative_tokens: int = config.num_speculative_tokens

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """Target layers whose outputs (hidden states [T, H]) this drafter reads; () = none."""
        return ()

    @property
    def max_chain_drafts(self) -> int:
        """The most drafts of one chain (the longest verification query is this + 1); below
        ``num_speculative_tokens`` for drafters whose proposals are trees of that many nodes."""
        return self.num_speculative_tokens

    @property
    def reads_plain_step_captured(self) -> bool:
        """Whether ``observe_plain_step`` reads its ``captured`` tensors (False: they are requested for the
        forward's side effects only, and CUDA graphs need not copy them out)."""
        return True

    def memory_bytes(self) -> int:
        """Device memory the drafter holds (weights + caches), counted against the KV-cache budget."""
        return 0

    def kv_bytes_per_block(self) -> int:
        """Bytes of the drafter's own cache per block of the target's KV cache, for a cache sized after the
        target's (it grows with it); the target sizes its cache with this added to its own per-block cost."""
        return 0

    def begin_step(self, inp):
        """Called before the target forward. Drafters that draft inside the target forward (FlexDraft's
        parallel mode) return the ``SideStream`` of tokens to add to it; others return None."""
        return

    def allocate(self, num_kv_blocks: int) -> None:
        """Called once after the target's KV cache exists (drafters with their own caches size them here)."""

    def capture_graphs(self, batch_sizes: list[int]) -> None:
        """Called after the target's CUDA graphs are captured (GPU, ``enforce_eager`` off): drafters whose
        drafting forward has a fixed shape per batch size capture it here (see ``BatchGraphs``). Raising
        leaves the drafter eager."""

    @abstractmethod
    def propose(self, batch: list[SeqDraftInput], captured: list[torch.Tensor]) -> DraftProposal:
        """Return drafts for every sequence of ``batch`` (empty lists where ``num_drafts`` is 0).

        ``captured`` holds the target's outputs of ``capture_layers`` for this step's tokens, [T, H] each.
        """

    def propose_on_device(
        self,
        inp,  # ModelInput of a verification step: queries [last token, drafts...] (and prompt chunks)
        tokens: torch.Tensor,  # [S, K + 1] int64: the target's token at each of the sequence's logits rows
        accepted: torch.Tensor,  # [S] int64: accepted drafts a (the step emits tokens[s, :a + 1])
        captured: list[torch.Tensor],  # ``capture_layers`` outputs for the step's rows, [>= T, H] each
        path: torch.Tensor | None = None,  # [S, K] int64 accepted tree nodes (``device_trees`` drafters only)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # drafts [S, D] int64, keep [S] int64
        """Drafts for the next step of ``proposes_on_device`` drafters, enqueued without a host sync: the
        committed tokens of sequence s are its inputs 0 .. a (positions ``context_lens[s] ..``) plus the new
        last token ``tokens[s, a]``. Returns up to D drafts per sequence and how many are worth verifying (the
        worker also cuts to ``num_speculative_tokens`` and to the room left). When ``inp.num_speculative_tokens``
        is 0 (the step only verifies), drafters update their state only and may return D = 0.

        Some queries may be prompt chunks (chunked prefill in a speculative batch: no drafts,
        every input committed): a chunk that ends its prompt emits ``tokens[s, 0]`` (its last row's logits),
        the others emit nothing (``inp.samples[s]`` False; their ``tokens`` rows are meaningless and their
        drafts are dropped). After a step that verified draft trees, ``path[s, k]`` is the accepted node of depth
        k + 1 (``flexspec_kernels.draft_tree.accept_tree_drafts``): its row holds position ``context_lens[s] + 1
        + k``'s hidden states."""
        raise NotImplementedError(f"{type(self).__name__} does not draft on the device")

    def observe_plain_step(self, inp, captured: list[torch.Tensor]) -> None:
        """A plain step launched by the runner (``observes_plain_steps``): every input of ``inp`` is committed
        (no drafts verified, none proposed); ``captured`` holds ``capture_layers`` for its rows, [T, H] each.
        Must only enqueue device work (the step's tokens are read back later)."""
        raise NotImplementedError(f"{type(self).__name__} does not observe launched plain steps")

    def free(self, seq_ids: list[int]) -> None:
        """Forget per-sequence state (finished, aborted or preempted sequences)."""


def confident_prefix_len(top_probs: torch.Tensor, threshold: float) -> torch.Tensor:
    """Selective verification (FlexDraft, arXiv 2605.20022): top_probs [S, n] (each draft's probability under
    the drafter) -> drafts worth verifying [S] int64: the longest prefix whose cumulative product stays >=
    ``threshold``, at least 1. Sync-free."""
    conf = top_probs.double().cumprod(-1)  # non-increasing, so the count is a prefix length
    return (conf >= threshold).sum(-1).clamp(min=1)
