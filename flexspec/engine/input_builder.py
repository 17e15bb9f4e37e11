"""A step's ``ModelInput`` built from the scheduler's batch (``LLMEngine.build_model_input`` adds the policy's
decision and the finished sequences): flattened token ids, positions and slot mapping (``block_table[pos //
block_size] * block_size + pos % block_size``), per-sequence metadata and the sampling rows of the logits rows."""

from __future__ import annotations

from flexspec.engine.model_input import ModelInput
from flexspec.engine.scheduler import ScheduledSequence
from flexspec.spec.tree import depths


def plain_decode_input(scheduled: list[ScheduledSequence], bs: int) -> ModelInput:
    """``LLMEngine.build_model_input`` for a batch of one new token per sequence and no drafts (most steps of plain
    decoding; a prompt's last token alone counts too): the same input, built column by column."""
    seqs = [s.seq for s in scheduled]
    positions = [seq.num_computed_tokens for seq in seqs]
    tables = [seq.block_table for seq in seqs]
    n = len(seqs)
    # A sequence samples when its one new token is its last: every decode step; not a prompt chunk.
    samples = [p + 1 == len(seq.token_ids) for seq, p in zip(seqs, positions)]
    inp = ModelInput(
        input_ids=[seq.token_ids[p] for seq, p in zip(seqs, positions)],
        positions=positions,
        slot_mapping=[t[p // bs] * bs + p % bs for t, p in zip(tables, positions)],
        block_tables=tables,
        context_lens=list(positions),
        query_lens=[1] * n,
        logits_indices=[],
        seq_ids=[seq.seq_id for seq in seqs],
        num_draft_tokens=[0] * n,
        samples=samples,
        max_lens=[seq.max_len for seq in seqs],
    )
    num_logprobs: int | None = None
    rows = inp.sampling_rows
    for i, seq in enumerate(seqs):
        if samples[i]:
            p = seq.params
            inp.logits_indices.append(i)
            rows.append((p.temperature, p.top_p, p.top_k, seq.seed, positions[i] + 1 - seq.num_prompt_tokens))
            if p.logprobs is not None:
                num_logprobs = max(num_logprobs or 0, p.logprobs)
    inp.num_logprobs = num_logprobs
    return inp


def verify_decode_input(scheduled: list[ScheduledSequence], bs: int) -> ModelInput | None:
    """``LLMEngine.build_model_input`` for a batch of verification queries: every sequence's query is its last
    token followed by a chain of ``d >= 0`` drafts (``num_new_tokens == 1 + d``), and every token row is a
    logits row (the steady state of speculative decoding). The same input as :func:`general_input`, with the
    per-sequence branches gone (session 45: ~0.4 ms of ``general_input`` at batch 64 sat on the critical path of
    every speculative step). Returns None when some sequence is not such a query (a prompt chunk, a draft
    tree): the caller then builds the general input."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    rows: list[tuple[float, float, int, int, int]] = []
    num_logprobs: int | None = None
    for s in scheduled:
        seq = s.seq
        d = s.num_draft_tokens
        start = seq.num_computed_tokens
        token_ids = seq.token_ids
        if s.num_new_tokens != d + 1 or start + 1 != len(token_ids) or (d and seq.draft_parents is not None):
            return None
        end = start + d + 1
        ids.append(token_ids[start])
        if d:
            ids.extend(seq.draft_token_ids[:d])
        positions.extend(range(start, end))
        table = seq.block_table
        blk = start // bs
        if (end - 1) // bs == blk:  # the query sits in one KV block (the common case)
            base = table[blk] * bs - blk * bs
            slots.extend(range(base + start, base + end))
        else:
            slots.extend(table[pos // bs] * bs + pos % bs for pos in range(start, end))
        p = seq.params
        num_out = start + 1 - seq.num_prompt_tokens
        t, top_p, top_k, seed = p.temperature, p.top_p, p.top_k, seq.seed
        rows.extend([(t, top_p, top_k, seed, num_out + j) for j in range(d + 1)])
        if p.logprobs is not None:
            num_logprobs = max(num_logprobs or 0, p.logprobs)
    seqs = [s.seq for s in scheduled]
    return ModelInput(
        input_ids=ids,
        positions=positions,
        slot_mapping=slots,
        block_tables=[seq.block_table for seq in seqs],
        context_lens=[seq.num_computed_tokens for seq in seqs],
        query_lens=[s.num_new_tokens for s in scheduled],
        logits_indices=list(range(len(ids))),
        sampling_rows=rows,
        num_logprobs=num_logprobs,
        seq_ids=[seq.seq_id for seq in seqs],
        num_draft_tokens=[s.num_draft_tokens for s in scheduled],
        samples=[True] * len(seqs),
        max_lens=[seq.max_len for seq in seqs],
    )


def general_input(scheduled: list[ScheduledSequence], bs: int) -> ModelInput:
    """``LLMEngine.build_model_input`` for any batch: prompt chunks, decode and verification queries."""
    inp = ModelInput([], [], [], [], [], [], [])
    ids, positions, slots, logits_indices, rows = (
        inp.input_ids,
        inp.positions,
        inp.slot_mapping,
        inp.logits_indices,
        inp.sampling_rows,
    )
    num_logprobs: int | None = None
    trees: list[list[int] | None] = []  # [S] the tree of each sequence's verified drafts (None: a chain)
    for s in scheduled:
        seq = s.seq
        start = seq.num_computed_tokens
        n, d = s.num_new_tokens, s.num_draft_tokens
        samples = start + n == len(seq.token_ids) + d  # ScheduledSequence.samples, inlined (hot loop)
        first_row = len(ids)
        table = seq.block_table
        if n == 1 and d == 0:  # a plain decode step: the last token
            ids.append(seq.token_ids[start])
            positions.append(start)
            slots.append(table[start // bs] * bs + start % bs)
            tree = tree_depths = None
        else:
            ids.extend(s.token_ids)
            end = start + n
            if d and seq.draft_parents is not None:  # tree nodes sit at the root's position + their depth
                tree = seq.draft_parents[:d]  # topological order: a cut tree is a tree
                tree_depths = depths(tree)
                root = end - d - 1
                positions.extend(range(start, root + 1))
                positions.extend(root + depth for depth in tree_depths)
            else:
                tree = tree_depths = None
                positions.extend(range(start, end))
            # slots block by block: one range per KV block the tokens fall in
            pos = start
            while pos < end:
                stop = min(end, (pos // bs + 1) * bs)
                base = table[pos // bs] * bs - (pos // bs) * bs
                slots.extend(range(base + pos, base + stop))
                pos = stop
        trees.append(tree)
        inp.block_tables.append(table)
        inp.context_lens.append(start)
        inp.query_lens.append(n)
        inp.seq_ids.append(seq.seq_id)
        inp.num_draft_tokens.append(d)
        inp.samples.append(samples)
        p = seq.params
        inp.max_lens.append(seq.max_len)
        if samples:  # logits rows: the last token before the drafts, then each draft
            num_out = len(seq.token_ids) - seq.num_prompt_tokens
            first = first_row + n - 1 - d
            logits_indices.extend(range(first, first + d + 1))
            t, top_p, top_k, seed = p.temperature, p.top_p, p.top_k, seq.seed
            # each row samples its own output position (a tree node's: its depth), as plain decoding would
            offsets = range(d + 1) if tree_depths is None else [0, *tree_depths]
            rows.extend([(t, top_p, top_k, seed, num_out + j) for j in offsets])
            if p.logprobs is not None:
                num_logprobs = max(num_logprobs or 0, p.logprobs)
    inp.num_logprobs = num_logprobs
    if any(t is not None for t in trees):
        inp.draft_parents = trees
    return inp
