"""The CPU path of the linear layers (``flexspec.layers.linear.linear``): the skinny-batch form equals
``F.linear`` up to fp32 summation order, with and without bias, and other shapes go to ``F.linear`` itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flexspec.layers.linear import SKINNY_CPU_ROWS, linear


@pytest.mark.parametrize("rows", [1, 2, 7, 8, 32, 33, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g)
    w = torch.randn(160, 96, generator=g)
    b = torch.randn(160, generator=g) if bias else None
    got, want = linear(x, w, b), F.linear(x, w, b)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    lo, hi = SKINNY_CPU_ROWS
    if not lo <= rows <= hi:
        assert torch.equal(got, want)  # F.linear itself


def test_linear_keeps_other_dtypes_and_ranks_on_f_linear():
    x = torch.randn(4, 3, 32)
    w = torch.randn(16, 32)
    assert torch.equal(linear(x, w), F.linear(x, w))
    xh, wh = x[0].to(torch.bfloat16), w.to(torch.bfloat16)
    assert torch.equal(linear(xh, wh), F.linear(xh, wh))
