"""expand_mask_groups: Triton vs reference vs a per-group Python loop."""

import pytest
import torch

from flexspec_kernels import MaskGroups, expand_mask_groups, expand_mask_groups_ref, expand_mask_groups_triton


def _loop_expand(last_pos, num_groups, block_tables, block_size, max_position):
    """Brute force, as FlexDraft's ``_side_stream`` builds it: one group at a time."""
    B = block_size
    positions, context_lens, tables, group_seq = [], [], [], []
    for s, (last, n) in enumerate(zip(last_pos.tolist(), num_groups.tolist())):
        for k in range(n):
            context_lens.append(last + k + 1)
            positions.extend(min(last + k + 1 + j, max_position) for j in range(B))
            tables.append(block_tables[s].tolist())
            group_seq.append(s)
    G = len(context_lens)
    width = block_tables.shape[1]
    return MaskGroups(
        positions=torch.tensor(positions, dtype=torch.int64),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32).reshape(G, width),
        query_start_loc=torch.tensor([g * B for g in range(G + 1)], dtype=torch.int32),
        mask_start_loc=torch.tensor([g * B * B for g in range(G + 1)], dtype=torch.int64),
        slot_mapping=torch.full((G * B,), -1, dtype=torch.int64),
        mask=torch.ones(G * B * B, dtype=torch.bool),
        group_seq=torch.tensor(group_seq, dtype=torch.int32),
    )


def _case(num_seqs, width, seed):
    g = torch.Generator().manual_seed(seed)
    last_pos = torch.randint(0, 100, (num_seqs,), generator=g, dtype=torch.int64)
    num_groups = torch.randint(0, 6, (num_seqs,), generator=g, dtype=torch.int32)
    if num_seqs > 1:
        num_groups[torch.randint(0, num_seqs, (1,), generator=g)] = 0  # a sequence not drafting
    block_tables = torch.randint(0, 1000, (num_seqs, width), generator=g, dtype=torch.int32)
    return last_pos, num_groups, block_tables


def _assert_same(actual: MaskGroups, expected: MaskGroups) -> None:
    for name, a, e in zip(MaskGroups._fields, actual, expected):
        assert a.dtype == e.dtype, (name, a.dtype, e.dtype)
        assert torch.equal(a.cpu(), e), (name, a, e)


@pytest.mark.parametrize("block_size", [4, 16, 3])  # 3: non-power-of-two B (masked lanes)
@pytest.mark.parametrize("num_seqs,width,seed", [(1, 1, 0), (3, 5, 1), (6, 9, 2), (6, 2, 3), (5, 0, 4)])
def test_triton_matches_loop(num_seqs, width, seed, block_size, device):
    last_pos, num_groups, block_tables = _case(num_seqs, width, seed)
    G = int(num_groups.sum())
    unclamped = _loop_expand(last_pos, num_groups, block_tables, block_size, 2**40).positions
    max_position = int(unclamped.max()) - 2 if G else 0  # the last group's tail clamps
    expected = _loop_expand(last_pos, num_groups, block_tables, block_size, max_position)
    assert G == 0 or (expected.positions == max_position).sum() >= 3

    args = (block_size, G, max_position)
    _assert_same(expand_mask_groups_ref(last_pos, num_groups, block_tables, *args), expected)
    dev_inputs = (last_pos.to(device), num_groups.to(device), block_tables.to(device))
    _assert_same(expand_mask_groups_triton(*dev_inputs, *args), expected)


def test_clamping_and_empty_sequences(device):
    last_pos = torch.tensor([10, 5, 60, 3], dtype=torch.int64)
    num_groups = torch.tensor([0, 2, 3, 0], dtype=torch.int32)
    block_tables = torch.arange(12, dtype=torch.int32).reshape(4, 3)
    expected = _loop_expand(last_pos, num_groups, block_tables, 4, 63)
    assert expected.group_seq.tolist() == [1, 1, 2, 2, 2]
    assert expected.context_lens.tolist() == [6, 7, 61, 62, 63]
    assert expected.positions[-4:].tolist() == [63, 63, 63, 63]
    for fn in (expand_mask_groups_ref, expand_mask_groups_triton):
        out = fn(last_pos.to(device), num_groups.to(device), block_tables.to(device), 4, 5, 63)
        _assert_same(out, expected)


@pytest.mark.parametrize("num_seqs", [0, 3])
def test_no_groups(num_seqs, device):
    last_pos = torch.zeros(num_seqs, dtype=torch.int64, device=device)
    num_groups = torch.zeros(num_seqs, dtype=torch.int32, device=device)
    block_tables = torch.zeros(num_seqs, 4, dtype=torch.int32, device=device)
    for fn in (expand_mask_groups_ref, expand_mask_groups_triton):
        out = fn(last_pos, num_groups, block_tables, 16, 0, 100)
        assert out.positions.shape == (0,) and out.block_tables.shape == (0, 4)
        assert out.query_start_loc.tolist() == [0] and out.mask_start_loc.tolist() == [0]


def test_dispatch():
    last_pos, num_groups, block_tables = _case(4, 3, 7)
    G = int(num_groups.sum())
    expected = _loop_expand(last_pos, num_groups, block_tables, 4, 50)
    _assert_same(expand_mask_groups(last_pos, num_groups, block_tables, 4, G, 50), expected)  # auto -> ref
    with pytest.raises(ValueError, match="backend"):
        expand_mask_groups(last_pos, num_groups, block_tables, 4, G, 50, backend="cuda")


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a: a.update(last_pos=a["last_pos"].int()), "last_pos"),
        (lambda a: a.update(num_groups=a["num_groups"].long()), "num_groups"),
        (lambda a: a.update(num_groups=a["num_groups"][:2]), "num_groups"),
        (lambda a: a.update(last_pos=torch.zeros(3, 2, dtype=torch.int64)[:, 0]), "last_pos"),
        (lambda a: a.update(block_tables=a["block_tables"].long()), "block_tables"),
        (lambda a: a.update(block_tables=a["block_tables"][0]), "block_tables"),
        (lambda a: a.update(block_tables=torch.zeros(4, 3, dtype=torch.int32).t()), "contiguous"),
        (lambda a: a.update(block_size=0), "block_size"),
        (lambda a: a.update(num_total_groups=-1), "num_total_groups"),
        (lambda a: a.update(max_position=-1), "max_position"),
        (
            lambda a: a.update(
                last_pos=a["last_pos"][:0], num_groups=a["num_groups"][:0], block_tables=a["block_tables"][:0]
            ),
            "num_total_groups",
        ),
        (lambda a: a.update(last_pos=a["last_pos"].to("meta")), "device"),
    ],
)
def test_bad_arguments_raise(mutate, match):
    last_pos, num_groups, block_tables = _case(3, 4, 0)
    args = {
        "last_pos": last_pos,
        "num_groups": num_groups,
        "block_tables": block_tables,
        "block_size": 4,
        "num_total_groups": int(num_groups.sum()),
        "max_position": 50,
    }
    mutate(args)
    for fn in (expand_mask_groups_ref, expand_mask_groups_triton):
        with pytest.raises(ValueError, match=match):
            fn(**args)
