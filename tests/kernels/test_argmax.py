"""Row-wise argmax (``flexspec_kernels.argmax``) vs ``torch.argmax``: ties, -inf rows, tile edges, strides, errors."""

import pytest
import torch

from flexspec_kernels.argmax import argmax, argmax_triton


@pytest.mark.parametrize("vocab", [1, 100, 8192, 8193, 49152])
@pytest.mark.parametrize("rows", [1, 5])
def test_argmax_matches_torch(vocab, rows, device):
    g = torch.Generator().manual_seed(vocab + rows)
    x = (torch.randn(rows, vocab, generator=g) * 4).to(device)
    if vocab > 50:  # ties across tiles and lanes: the lowest index wins
        x[0, vocab - 1] = x[0, 3] = x[0, vocab // 2] = 1e4
    if rows > 1:
        x[1] = float("-inf")  # nothing beats -inf: index 0
        x[2, -1] = 1e5  # the last entry, past the last full tile
    want = x.argmax(-1)
    got = argmax_triton(x, block=1024)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert torch.equal(argmax(x, backend="triton"), want)


def test_argmax_bf16_strided_and_errors(device):
    x = torch.randn(4, 300, device=device).to(torch.bfloat16)
    x[2, 17] = x[2, 200] = 50
    assert torch.equal(argmax_triton(x, block=128), x.argmax(-1))
    wide = torch.randn(3, 2 * 300, device=device)
    rows = wide[:, :300]  # row stride 600
    assert torch.equal(argmax_triton(rows, block=128), rows.argmax(-1))
    assert torch.equal(
        argmax(wide.t()), wide.t().argmax(-1)
    )  # "auto" falls back to torch for a column stride
    with pytest.raises(ValueError, match="unit stride"):
        argmax_triton(wide.t())
    with pytest.raises(ValueError, match="empty row"):
        argmax_triton(torch.zeros(2, 0, device=device))
