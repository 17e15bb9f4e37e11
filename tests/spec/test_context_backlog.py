"""DFlash's context backlog: plain steps park their target features and the drafter's context K/V is written
later in batches (``context_backlog``); the drafts, hence the accepted tokens, equal those of writing the
context in every plain step, and plain decode steps run no context projection at all (issue 6)."""

from __future__ import annotations

import pytest
import torch

from configs import SamplingParams
from flexspec.spec.models.draft_kv import ContextBacklog
from flexspec.spec.policy import Decision
from tests.spec.conftest import spec_engine

DFLASH = {"method": "dflash", "model": "smollm2-135m-instruct-dflash", "num_speculative_tokens": 4}


def test_ring_holds_contiguous_runs_and_releases_them():
    b = ContextBacklog(4, max_num_seqs=2, feat_dim=3, dtype=torch.float32, device="cpu")
    assert not b.can_hold(7, 0, 1)  # not allocated: nothing is held
    b.allocate()
    assert b.can_hold(7, 10, 3) and not b.can_hold(7, 10, 5)  # at most ``size`` positions
    rows = b.hold(7, 10, 3)
    assert rows == [b.row_of[7] * 4 + p % 4 for p in (10, 11, 12)]
    assert b.can_hold(7, 13, 1) and not b.can_hold(7, 13, 2)  # 10 .. 14 would be 5
    assert not b.can_hold(7, 14, 1)  # a gap (position 13 missing): not one run
    b.hold(7, 13, 1)
    assert b.take(7, before=12) == ([10, 11], [b.row_of[7] * 4 + p % 4 for p in (10, 11)])
    assert b.take(7) == ([], [])  # released, the ring row kept for the sequence
    b.hold(8, 0, 2)
    assert not b.can_hold(9, 0, 1)  # both ring rows taken
    b.drop(8)
    assert b.can_hold(9, 0, 1) and 8 not in b.pending


def _run(prompts, backlog: int, plain_steps: int):
    """Fixed decisions (``plain_steps`` plain steps, then one that drafts), so both runs decide alike."""
    eng = spec_engine({**DFLASH, "context_backlog": backlog}, max_num_seqs=4)
    n = {"decisions": 0, "context_writes": 0, "held": 0}

    def decide(sched):
        n["decisions"] += 1
        return Decision("decoupled", 4) if n["decisions"] % (plain_steps + 1) == 0 else Decision("plain", 0)

    drafter = eng.executor.runner.spec_worker.drafter
    store, hold = drafter.model.store_context, drafter._hold_rows

    def counted_store(*args):
        n["context_writes"] += 1
        return store(*args)

    def counted_hold(src, dst, captured):
        n["held"] += len(src)
        return hold(src, dst, captured)

    eng.policy.decide = decide
    drafter.model.store_context = counted_store
    drafter._hold_rows = counted_hold
    outs = eng.generate(prompts, SamplingParams(max_tokens=40, temperature=0))
    m = eng.spec_metrics
    # Held positions and ring rows live exactly as long as the sequence's drafter cache (the last finished
    # sequences are freed with the next step's input, so only theirs are left).
    assert set(drafter.backlog.pending) <= set(drafter.backlog.row_of) <= set(drafter.cache.tables)
    assert len(drafter.backlog.row_of) + len(drafter.backlog.free_rows) == 4
    return [o.token_ids for o in outs], m.num_draft_tokens, m.num_accepted_tokens, n


@pytest.mark.parametrize("plain_steps,backlog", [(7, 64), (9, 4)], ids=["fits", "overflows"])
def test_backlog_drafts_equal_writing_context_every_step(plain_128, plain_steps, backlog):
    prompts, want = plain_128
    prompts, want = prompts[2::5], [w[:40] for w in want[2::5]]
    tokens_b, drafts_b, accepted_b, n_b = _run(prompts, backlog, plain_steps)
    tokens_e, drafts_e, accepted_e, n_e = _run(prompts, 0, plain_steps)
    assert tokens_b == tokens_e == want
    assert accepted_e > 0
    assert (drafts_b, accepted_b) == (drafts_e, accepted_e)
    assert n_e["held"] == 0 and n_b["held"] > 0
    # Plain decode steps projected nothing: far fewer context steps ran (prefills, steps that verify and steps
    # that draft still do: ~2 of each 8 with 7 plain steps per drafting step, ~4 of 10 with a backlog of 4).
    assert n_b["context_writes"] < n_e["context_writes"] * 0.5, (n_b, n_e)
