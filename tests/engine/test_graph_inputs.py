"""Decode-graph input staging (one host buffer, one copy per step) and lazily built sampling tensors (issue 2).

The CUDA graphs themselves run only on a GPU; their input layout is plain host code, checked here against a
direct construction of the padded layout.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from flexspec.engine.graph_inputs import StagedInputs, stage_decode_inputs, write_table_rows
from flexspec.engine.model_input import ModelInput
from flexspec.engine.sampler import SamplingMetadata, sample

MAX_BLOCKS, MAX_POSITION = 6, 1000


def make_stage(max_bs: int, q: int) -> StagedInputs:
    n = max_bs * q
    sizes = {"input_ids": n, "positions": n, "slot_mapping": n, "context_lens": max_bs,
             "block_tables": max_bs * MAX_BLOCKS, "logits_rows": n, "token_rows": n}  # fmt: skip
    return StagedInputs(sizes, torch.device("cpu"))


def make_input(query_lens: list[int], logits_per_seq: str = "last") -> ModelInput:
    ids, pos, slots, tables, ctx, logits = [], [], [], [], [], []
    r = 0
    for s, n in enumerate(query_lens):
        c = 7 * s + 3
        ids += [100 * s + i for i in range(n)]
        pos += [c + i for i in range(n)]
        slots += [16 * (s + 1) + c + i for i in range(n)]
        tables.append(list(range(s + 1, s + 1 + (c + n + 15) // 16)))
        ctx.append(c)
        logits += [r + n - 1] if logits_per_seq == "last" else list(range(r, r + n))
        r += n
    return ModelInput(ids, pos, slots, tables, ctx, query_lens, logits)


def reference_layout(inp: ModelInput, q: int, bs: int) -> dict[str, list[int]]:
    """The padded layout built token by token (dummy sequences at the end)."""
    out: dict[str, list[int]] = {"input_ids": [], "positions": [], "slot_mapping": [], "rows": []}
    r = 0
    for s, n in enumerate(inp.query_lens):
        for i in range(q):
            real = i < n
            out["input_ids"].append(inp.input_ids[r + i] if real else 0)
            last = inp.positions[r + n - 1]
            out["positions"].append(inp.positions[r + i] if real else min(last + 1 + i - n, MAX_POSITION))
            out["slot_mapping"].append(inp.slot_mapping[r + i] if real else -1)
            if real:
                out["rows"].append(s * q + i)
        r += n
    pad = (bs - len(inp.query_lens)) * q
    out["input_ids"] += [0] * pad
    out["positions"] += [0] * pad
    out["slot_mapping"] += [-1] * pad
    return out


@pytest.mark.parametrize(
    ("query_lens", "q", "logits_per_seq"),
    [
        ([1, 1, 1], 1, "last"),
        ([1], 1, "last"),
        ([3], 4, "all"),
        ([3, 1, 4], 4, "all"),
        ([2, 2], 4, "last"),
        ([4] * 5, 4, "all"),
    ],
)
def test_staged_layout_matches_padded_reference(query_lens, q, logits_per_seq):
    batch_sizes = [1, 2, 4, 8]
    stage = make_stage(8, q)
    # Garbage from an earlier, larger step must not leak into the rows this step uses.
    for name in ("input_ids", "positions", "slot_mapping", "context_lens"):
        stage.host(name)[:] = 99
    inp = make_input(query_lens, logits_per_seq)
    bs, direct = stage_decode_inputs(stage, inp, q, batch_sizes, MAX_BLOCKS, MAX_POSITION)
    stage.send()
    S = len(query_lens)
    assert bs == next(b for b in batch_sizes if b >= S)
    ref = reference_layout(inp, q, bs)
    for name in ("input_ids", "positions", "slot_mapping"):
        assert stage.on_device(name)[: bs * q].tolist() == ref[name], name
    ctx = stage.on_device("context_lens")[:bs].tolist()
    assert ctx == inp.context_lens + [0] * (bs - S)
    tables = stage.on_device("block_tables").view(-1, MAX_BLOCKS)
    for s, row in enumerate(inp.block_tables):
        assert tables[s, : len(row)].tolist() == row
    assert direct == (q == 1)
    if not direct:
        want = [ref["rows"][i] for i in inp.logits_indices]
        assert stage.on_device("logits_rows")[: len(want)].tolist() == want
    if q > 1:
        assert stage.on_device("token_rows")[: inp.num_tokens].tolist() == ref["rows"]


def test_greedy_sampling_builds_no_device_tensors():
    logits = torch.randn(4, 50)
    greedy = SamplingMetadata([(0.0, 1.0, -1, 0, i) for i in range(4)], torch.device("cpu"))
    assert sample(logits, greedy).tolist() == logits.argmax(-1).tolist()
    assert not {"temperature", "top_p", "top_k"} & set(vars(greedy))  # nothing was materialized
    mixed = SamplingMetadata(
        [(0.0, 1.0, -1, 0, 0), (0.7, 0.9, 5, 1, 0), (1.0, 1.0, -1, 2, 0), (0.0, 1.0, -1, 3, 0)],
        torch.device("cpu"),
    )
    out = sample(logits, mixed)
    assert out[0] == logits[0].argmax() and out[3] == logits[3].argmax()
    assert mixed.temperature.tolist() == pytest.approx([0.0, 0.7, 1.0, 0.0])
    sub = mixed.select([1, 3])
    assert sub.top_k.tolist() == [5, -1] and sub.any_greedy and not sub.all_greedy


@pytest.mark.parametrize("seed", range(5))
def test_block_table_rows_are_written_where_they_changed(seed):
    """Staged block-table rows stay equal to the sequences' tables over steps in which tables grow, sequences
    are freed (a new list) and rows change hands; a row whose table did not change is not rewritten."""
    rng = random.Random(seed)
    width = 12
    dest = np.zeros((8, width), dtype=np.int64)
    written: list = []
    tables = [[rng.randrange(100)] for _ in range(10)]  # the "sequences'" block tables
    for _ in range(60):
        for t in tables:
            r = rng.random()
            if r < 0.3 and len(t) < width:
                t.append(rng.randrange(100))  # grows in place
        for i in range(len(tables)):
            if rng.random() < 0.05:
                tables[i] = [rng.randrange(100)]  # freed and allocated again: a new list
        batch = rng.sample(tables, rng.randint(1, 8)) if rng.random() < 0.2 else tables[:8]
        write_table_rows(dest, written, batch)
        for s, t in enumerate(batch):
            assert dest[s, : len(t)].tolist() == t
    dest[0, 0] = -5  # not rewritten while row 0's table is unchanged
    write_table_rows(dest, written, batch)
    assert dest[0, 0] == -5
