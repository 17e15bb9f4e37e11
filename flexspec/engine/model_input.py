"""What one engine step asks every TP rank to compute: plain Python values, cheap to send to Ray actors."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    sampling_rows: list[tuple[float, float, int, int, int]] = field(default_factory=list)  # [N] (T, p, k, seed, off)
    num_logprobs: int | None = None  # max top-logprobs over rows; None = no logprobs
    capture_layers: tuple[int, ...] = ()  # target layers whose outputs the drafter needs

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def is_pure_decode(self) -> bool:
        return all(q == 1 for q in self.query_lens) and len(self.logits_indices) == len(self.query_lens)


@dataclass
class ModelOutput:
    """Rank 0's answer: one sampled token per logits row (+ logprobs if asked)."""

    token_ids: list[int]  # [N]
    logprobs: list[float] | None = None  # [N]
    top_logprobs: list[list[tuple[int, float]]] | None = None  # [N][k]
