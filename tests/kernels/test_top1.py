"""Top-1 softmax (``flexspec_kernels.top1``) vs ``x.float().softmax(-1).max(-1)``: dtypes, ties, -inf entries and
rows, tile edges, strides, errors."""

import pytest
import torch

from flexspec_kernels.top1 import top1_softmax, top1_softmax_ref, top1_softmax_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 100, 1024, 1025, 49152])
def test_top1_softmax_matches_torch(vocab, dtype, device):
    g = torch.Generator().manual_seed(vocab)
    x = (torch.randn(6, vocab, generator=g) * 4).to(device=device, dtype=dtype)
    if vocab > 50:
        x[0, vocab - 1] = x[0, 3] = x[0, vocab // 2] = 60  # a tie across tiles and lanes: the lowest index
        x[1, 7] = x[1, 40] = float("-inf")  # -inf entries weigh nothing
        x[2, -1] = 80  # the last entry, past the last full tile: a confident row (prob ~1)
        x[3] = 0.0  # a flat row: prob 1 / V
    want_p, want_i = x.float().softmax(-1).max(-1)
    got_p, got_i = top1_softmax_triton(x, block=1024)
    assert got_p.dtype == torch.float32 and got_i.dtype == torch.int64
    assert torch.equal(got_i, want_i)
    torch.testing.assert_close(got_p, want_p, rtol=1e-5, atol=1e-7)
    for backend in ("triton", "auto"):
        p, i = top1_softmax(x, backend=backend)
        assert torch.equal(i, want_i)
        torch.testing.assert_close(p, want_p, rtol=1e-5, atol=1e-7)


def test_top1_softmax_edge_rows_strides_and_errors(device):
    x = torch.randn(3, 300, device=device)
    x[1] = float("-inf")  # nothing finite: index 0, probability NaN, as torch
    p, i = top1_softmax_triton(x, block=128)
    want_p, want_i = top1_softmax_ref(x)
    assert torch.equal(i, want_i) and i[1].item() == 0
    assert torch.isnan(p[1]) and torch.isnan(want_p[1])
    torch.testing.assert_close(p[[0, 2]], want_p[[0, 2]])
    wide = torch.randn(4, 600, device=device)
    rows = wide[:, :300]  # row stride 600
    torch.testing.assert_close(top1_softmax_triton(rows, block=128)[0], top1_softmax_ref(rows)[0])
    p, i = top1_softmax(wide.t())  # "auto" falls back to torch for a column stride
    assert torch.equal(i, wide.t().argmax(-1))
    with pytest.raises(ValueError, match="unit stride"):
        top1_softmax_triton(wide.t())
    with pytest.raises(ValueError, match="empty row"):
        top1_softmax_triton(torch.zeros(2, 0, device=device))
    p, i = top1_softmax_triton(torch.zeros(0, 5, device=device))
    assert p.shape == i.shape == (0,)
