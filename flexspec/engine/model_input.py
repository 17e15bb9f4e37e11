"""What one engine step asks every TP rank to compute: plain Python values, cheap to send to Ray actors."""

from __future__ import annotations

from dataclasses import dataclass, field

# Input id of a token that is sampled but not read back yet (async scheduling): the device gathers the real id
# (``ModelInput.prev_token_rows``); never embedded.
PLACEHOLDER_TOKEN_ID = -1


@dataclass
class ModelInput:
    """One step's batch, flattened. S sequences, T tokens, N logits rows."""

    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    slot_mapping: list[int]  # [T]; -1 = do not write K/V
    block_tables: list[list[int]]  # [S][<= max_blocks]
    context_lens: list[int]  # [S] tokens cached before this step
    query_lens: list[int]  # [S] new tokens per sequence (sum = T)
    logits_indices: list[int]  # [N] token rows that need logits
    sampling_rows: list[tuple[float, float, int, int, int]] = field(
        default_factory=list
    )  # [N] (T, p, k, seed, off)
    num_logprobs: int | None = None  # max top-logprobs over rows; None = no logprobs
    capture_layers: tuple[int, ...] = ()  # target layers whose outputs the drafter needs
    # False: the captured layers are run for their side effect only (DFlash's feature cache, written inside the
    # forward) and the graphs skip copying them out of their static buffers.
    keep_captured: bool = True
    # Async scheduling: [T] row of the previous launched step's sampled token ids that is each token's input id
    # (gathered on the device; ``input_ids`` holds placeholders there), or -1 where ``input_ids`` holds the id
    # (a prompt token of a step in which prompts join). None = the ids are ``input_ids``.
    prev_token_rows: list[int] | None = None
    # Speculative decoding (ignored without a drafter).
    seq_ids: list[int] = field(default_factory=list)  # [S]
    num_draft_tokens: list[int] = field(default_factory=list)  # [S] trailing draft tokens verified now
    samples: list[bool] = field(default_factory=list)  # [S] the step emits tokens for this sequence
    max_lens: list[int] = field(default_factory=list)  # [S] min(prompt + max_tokens, max_model_len)
    num_speculative_tokens: int = 0  # drafts to propose for the next step (0 = speculation off)
    spec_mode: str = "decoupled"  # "parallel" (draft inside the verification forward) | "decoupled"
    # the policy's warm-up profile: the device-side step keeps every draft it is allowed, not only the confident
    # prefix (selective verification), so each option's steps verify its full length (``flexspec.spec.warmup``)
    verify_all_drafts: bool = False
    # [S] the tree of each sequence's verified drafts (``flexspec.spec.tree``; None = a chain), or None when every
    # sequence's drafts are a chain: tree nodes sit at positions by depth and attend to their ancestors only.
    draft_parents: list[list[int] | None] | None = None
    finished_seq_ids: list[int] = field(default_factory=list)  # drafter state to free

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def is_pure_decode(self) -> bool:
        return all(q == 1 for q in self.query_lens) and len(self.logits_indices) == len(self.query_lens)


@dataclass
class ModelOutput:
    """Rank 0's answer, per sequence that emitted tokens this step (in batch order).

    Plain decoding emits one token per sequence; speculative decoding emits accepted drafts + 1.
    """

    token_ids: list[list[int]]  # [S_emit][num_emitted]
    logprobs: list[list[float]] | None = None  # [S_emit][num_emitted]
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None  # [S_emit][num_emitted][k]
    draft_token_ids: list[list[int]] | None = None  # [S_emit][k] drafts for the next step
    draft_parents: list[list[int] | None] | None = (
        None  # [S_emit] their trees (None: chains; flexspec.spec.tree)
    )
