"""Host staging of a fused verification tail's rows (``stage_tail_rows``): meta columns, drafter block tables
written incrementally, drafts (loop at small batch, numpy above), dummy rows zeroed; checked against rows built
one by one, over steps in which tables grow and rows change hands."""

from __future__ import annotations

import random

import numpy as np
import pytest

from flexspec.engine.model_input import ModelInput
from flexspec.spec.dflash_device import META_COLS
from flexspec.spec.fused_step import stage_tail_rows

TABLE_WIDTH, MAX_DRAFTS = 10, 5
META_WIDTH = META_COLS + TABLE_WIDTH


@pytest.mark.parametrize("num_seqs", [1, 3, 8, 9, 20])
def test_tail_rows_match_rows_built_one_by_one(num_seqs):
    rng = random.Random(num_seqs)
    bs = num_seqs + rng.randint(0, 3)
    host = np.full((bs + 2, META_WIDTH + MAX_DRAFTS), 77, dtype=np.int64)  # garbage from earlier steps
    record: list = []
    tables = [[rng.randrange(100)] for _ in range(num_seqs)]
    for _ in range(30):
        for s, t in enumerate(tables):
            if rng.random() < 0.3 and len(t) < TABLE_WIDTH:
                t.append(rng.randrange(100))
            elif rng.random() < 0.05:
                tables[s] = [rng.randrange(100)]  # freed and reserved again: a new list
        rng.shuffle(tables)  # rows change hands
        drafts = [rng.randint(0, MAX_DRAFTS) for _ in range(num_seqs)]
        ids = [rng.randrange(1, 1000) for _ in range(sum(d + 1 for d in drafts))]
        inp = ModelInput(ids, [], [], [], [], [d + 1 for d in drafts], [])
        inp.num_draft_tokens = drafts
        meta = [[rng.randrange(1000) for _ in range(META_COLS)] for _ in range(num_seqs)]
        stage_tail_rows(host, record, inp, meta, tables, META_WIDTH, bs)
        r = 0
        for s in range(num_seqs):
            row = host[s].tolist()
            assert row[:META_COLS] == meta[s]
            assert row[META_COLS : META_COLS + len(tables[s])] == tables[s]
            d = drafts[s]
            assert row[META_WIDTH:] == ids[r + 1 : r + 1 + d] + [0] * (MAX_DRAFTS - d)
            r += d + 1
        assert not host[num_seqs:bs].any()  # dummy sequences
