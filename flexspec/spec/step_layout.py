"""Which query layouts a speculative step has (the worker's tests for its device-side paths): every sequence a
decode query ``[last token, drafts...]``, or such queries next to prompt chunks, and each sequence's first logits
row."""

from __future__ import annotations

from flexspec.engine.model_input import ModelInput


def decode_queries_only(inp: ModelInput) -> bool:
    """Every sequence an emitting query ``[last token, drafts...]`` (no drafts: the first step of speculation)
    with logits on every row (checked first: no per-token work)."""
    return (
        all(inp.samples)
        and len(inp.logits_indices) == inp.num_tokens
        and all(q == d + 1 for q, d in zip(inp.query_lens, inp.num_draft_tokens))
    )


def mixed_layout(inp: ModelInput) -> bool:
    """Whether a step with prompt chunks fits the device-side verification step: some sequence emits, a
    sequence that verifies drafts is a decode query ``[last token, drafts...]``, and the logits rows are, in
    order, every row of each emitting decode query and the last row of each emitting prompt chunk."""
    if not any(inp.samples):
        return False
    expected: list[int] = []
    r = 0
    for q, d, emits in zip(inp.query_lens, inp.num_draft_tokens, inp.samples):
        if d and (q != d + 1 or not emits):
            return False
        if emits:
            expected.extend(range(r + q - d - 1, r + q))
        r += q
    return expected == inp.logits_indices


def emitting_starts(inp: ModelInput) -> list[int]:
    """[S] first logits row of each sequence: an emitting sequence owns its drafts + 1 rows (every row of a
    decode query, a prompt chunk's last); a sequence that emits nothing gets row 0 (read, then dropped)."""
    starts, r = [], 0
    for d, emits in zip(inp.num_draft_tokens, inp.samples):
        starts.append(r if emits else 0)
        if emits:
            r += d + 1
    return starts
