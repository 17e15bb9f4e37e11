"""The engine's step input (``LLMEngine.build_model_input``): the column-wise builder of plain decode batches
and the builder of verification batches give the same ``ModelInput`` as the general builder, and the general builder's slot mapping equals the
token-by-token rule ``block_table[pos // block_size] * block_size + pos % block_size`` across KV blocks."""

from __future__ import annotations

import dataclasses
import random

import pytest

from configs import SamplingParams
from flexspec.engine.input_builder import general_input, plain_decode_input, verify_decode_input
from flexspec.engine.model_input import PLACEHOLDER_TOKEN_ID
from flexspec.engine.scheduler import ScheduledSequence
from flexspec.engine.sequence import Sequence

BLOCK_SIZE = 4


def make_seq(rng: random.Random, i: int, *, decode: bool) -> ScheduledSequence:
    """A running sequence at a random point: decoding its last token (``decode``), or computing a prompt chunk
    of one token that may or may not end the prompt; random sampling settings, blocks in random order."""
    params = SamplingParams(
        max_tokens=rng.randint(1, 50),
        temperature=rng.choice([0.0, 0.7]),
        top_p=rng.choice([1.0, 0.9]),
        top_k=rng.choice([-1, 5]),
        logprobs=rng.choice([None, None, 2, 5]),
    )
    prompt = [rng.randrange(1, 1000) for _ in range(rng.randint(1, 30))]
    seq = Sequence(
        f"r{i}",
        prompt,
        params,
        seed=rng.getrandbits(30),
        max_model_len=rng.choice([40, 1000]),
        eos_token_ids=[2],
    )
    if decode:
        seq.token_ids += [
            rng.choice([rng.randrange(1, 1000), PLACEHOLDER_TOKEN_ID]) for _ in range(rng.randint(0, 9))
        ]
        seq.num_computed_tokens = len(seq.token_ids) - 1
    else:
        seq.num_computed_tokens = rng.randrange(len(prompt))
    needed = -(-(seq.num_computed_tokens + 1) // BLOCK_SIZE)
    seq.block_table = rng.sample(range(500), needed)
    return ScheduledSequence(seq, 1, 0)


@pytest.mark.parametrize("seed", range(20))
def test_plain_decode_builder_equals_the_general_builder(seed):
    rng = random.Random(seed)
    scheduled = [make_seq(rng, i, decode=rng.random() < 0.8) for i in range(rng.randint(1, 12))]
    fast = plain_decode_input(scheduled, BLOCK_SIZE)
    general = general_input(scheduled, BLOCK_SIZE)
    assert dataclasses.asdict(fast) == dataclasses.asdict(general)
    assert fast.samples == [s.samples for s in scheduled]  # the scheduler's own rule


@pytest.mark.parametrize("seed", range(10))
def test_general_builder_slots_follow_the_block_tables(seed):
    rng = random.Random(seed)
    scheduled = []
    for i in range(rng.randint(1, 6)):
        prompt = [rng.randrange(1, 1000) for _ in range(rng.randint(2, 40))]
        seq = Sequence(
            f"r{i}", prompt, SamplingParams(max_tokens=8), seed=0, max_model_len=None, eos_token_ids=[2]
        )
        seq.num_computed_tokens = rng.randrange(len(prompt))
        seq.draft_token_ids = [rng.randrange(1, 1000) for _ in range(rng.randint(0, 5))]
        n = len(prompt) - seq.num_computed_tokens
        d = len(seq.draft_token_ids) if n == 1 else 0  # drafts are verified by a decode query only
        seq.block_table = rng.sample(range(500), -(-(seq.num_computed_tokens + n + d) // BLOCK_SIZE))
        scheduled.append(ScheduledSequence(seq, n + d, d))
    inp = general_input(scheduled, BLOCK_SIZE)
    want_pos, want_slots = [], []
    for s in scheduled:
        table = s.seq.block_table
        for pos in range(s.seq.num_computed_tokens, s.seq.num_computed_tokens + s.num_new_tokens):
            want_pos.append(pos)
            want_slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    assert inp.positions == want_pos
    assert inp.slot_mapping == want_slots
    assert inp.input_ids == [t for s in scheduled for t in s.token_ids]


def verification_query(rng: random.Random, i: int) -> ScheduledSequence:
    """A decoding sequence verifying ``d`` in 0..6 of its drafts (a chain) after its last token, with random
    sampling settings; its query may cross KV blocks (``BLOCK_SIZE`` 4)."""
    sched = make_seq(rng, i, decode=True)
    seq = sched.seq
    seq.draft_token_ids = [rng.randrange(1, 1000) for _ in range(rng.randint(0, 6))]
    d = rng.randint(0, len(seq.draft_token_ids))  # the policy may verify fewer than were proposed
    seq.block_table += rng.sample(range(500, 1000), 2)  # room for the drafts
    return ScheduledSequence(seq, 1 + d, d)


@pytest.mark.parametrize("seed", range(20))
def test_verification_builder_equals_the_general_builder(seed):
    rng = random.Random(seed)
    scheduled = [verification_query(rng, i) for i in range(rng.randint(1, 12))]
    fast = verify_decode_input(scheduled, BLOCK_SIZE)
    assert fast is not None
    assert dataclasses.asdict(fast) == dataclasses.asdict(general_input(scheduled, BLOCK_SIZE))
    assert sum(s.num_draft_tokens for s in scheduled) + len(scheduled) == len(fast.logits_indices)


@pytest.mark.parametrize("case", ["prompt chunk", "tree", "stale query"])
def test_verification_builder_declines_other_batches(case):
    rng = random.Random(0)
    scheduled = [verification_query(rng, i) for i in range(4)]
    s = scheduled[2]
    if case == "prompt chunk":  # 5 of its 12 prompt tokens, from the 4th
        seq = Sequence(
            "p", list(range(1, 13)), SamplingParams(), seed=0, max_model_len=None, eos_token_ids=[2]
        )
        seq.num_computed_tokens, seq.block_table = 3, [7, 8]
        scheduled[2] = ScheduledSequence(seq, 5, 0)
    elif case == "tree":
        s.seq.draft_token_ids = [5, 6, 7]
        s.seq.draft_parents = [-1, -1, 0]
        scheduled[2] = ScheduledSequence(s.seq, 3, 2)
    else:  # the query does not start at the last token (num_computed_tokens lags behind)
        s.seq.num_computed_tokens -= 1
    assert verify_decode_input(scheduled, BLOCK_SIZE) is None
