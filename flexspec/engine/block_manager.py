"""Paged KV-cache block allocation (vLLM PagedAttention, arXiv 2309.06180)."""

from __future__ import annotations

from flexspec.engine.sequence import Sequence


class BlockManager:
    """Hands out fixed-size KV blocks; a sequence's ``block_table`` maps its logical blocks to physical ones.

    Free blocks form a stack: the blocks freed last are handed out first (block 0 first on a fresh cache).
    There is no prefix caching to keep freed blocks' contents for, and the set of blocks ever written stays
    that of the peak number in use, so a CPU cache (allocated without zeroing, its pages committed as first
    written) keeps only the peak's memory resident instead of cycling through all of it.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids = list(
            range(num_blocks - 1, -1, -1)
        )  # a stack: its top (the end) is handed out first

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of KV blocks in use, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks ``seq`` needs to hold ``num_tokens`` tokens of KV in total."""
        want = -(-num_tokens // self.block_size)
        return max(0, want - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq.block_table`` to cover ``num_tokens`` tokens. Caller checks ``can_allocate`` first."""
        n = self.blocks_needed(seq, num_tokens)
        if n > self.num_free_blocks:
            raise RuntimeError(f"KV cache out of blocks: need {n}, have {self.num_free_blocks}")
        seq.block_table.extend(self.free_block_ids.pop() for _ in range(n))

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s blocks; its cached tokens must be recomputed if it runs again."""
        self.free_block_ids.extend(reversed(seq.block_table))  # its first block on top
        seq.block_table = []
        seq.num_computed_tokens = 0
