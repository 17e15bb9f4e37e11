"""Speculative-decoding counters, named and defined as vLLM's (vllm:spec_decode_*).

MAL (mean acceptance length) = tokens emitted per verification step = 1 + accepted / drafts;
acceptance rate = accepted / draft tokens; per-position acceptance[i] = accepted at position i / drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingMetrics:
    num_drafts: int = 0  # verification steps of sequences that had drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Record one sequence's verification: ``num_accepted`` of its ``num_draft_tokens`` drafts passed."""
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.num_accepted_tokens_per_pos) < num_draft_tokens:
            self.num_accepted_tokens_per_pos.extend(
                [0] * (num_draft_tokens - len(self.num_accepted_tokens_per_pos))
            )
        for i in range(num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1

    def merge(self, other: SpecDecodingMetrics) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        n = max(len(self.num_accepted_tokens_per_pos), len(other.num_accepted_tokens_per_pos))
        a = self.num_accepted_tokens_per_pos + [0] * (n - len(self.num_accepted_tokens_per_pos))
        b = other.num_accepted_tokens_per_pos + [0] * (n - len(other.num_accepted_tokens_per_pos))
        self.num_accepted_tokens_per_pos = [x + y for x, y in zip(a, b)]

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / self.num_drafts for a in self.num_accepted_tokens_per_pos] if self.num_drafts else []

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "per_position_acceptance": [round(x, 4) for x in self.per_position_acceptance],
        }
