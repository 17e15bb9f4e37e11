"""The CPU path of the linear layers (``flexspec.layers.linear.linear``): oneDNN with a prepacked weight for
model parameters, the skinny-batch MKL form for 2-32 rows otherwise; both equal ``F.linear`` up to fp32
summation order, with and without bias, and other shapes, dtypes and autograd go to ``F.linear`` itself."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flexspec.layers.linear as L
from flexspec.layers.linear import SKINNY_CPU_ROWS, linear

needs_onednn = pytest.mark.skipif(
    not L._HAS_ONEDNN,
    reason="torch built without oneDNN (x86 / aarch64 CPU wheels have it: runs in CI and on dev machines)",
)


@pytest.mark.parametrize("rows", [1, 2, 7, 8, 32, 33, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g)
    w = torch.randn(160, 96, generator=g)  # a plain tensor: the MKL forms
    b = torch.randn(160, generator=g) if bias else None
    got, want = linear(x, w, b), F.linear(x, w, b)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    lo, hi = SKINNY_CPU_ROWS
    if not lo <= rows <= hi:
        assert torch.equal(got, want)  # F.linear itself


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_parameters_run_on_onednn_prepacked_and_rows_do_not_depend_on_the_batch(bias):
    g = torch.Generator().manual_seed(0)
    w = nn.Parameter(torch.randn(160, 96, generator=g), requires_grad=False)
    b = nn.Parameter(torch.randn(160, generator=g), requires_grad=False) if bias else None
    x = torch.randn(64, 96, generator=g)
    full = linear(x, w, b)
    torch.testing.assert_close(full, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    packed = L._PREPACKED[w]
    assert packed[1].is_mkldnn
    for rows in (1, 2, 8, 33):  # a row's result does not depend on how many rows share the GEMM
        assert torch.equal(linear(x[:rows], w, b), full[:rows])
    assert torch.equal(linear(x.view(8, 8, 96), w, b), full.view(8, 8, 160))  # leading dims kept
    assert L._PREPACKED[w] is packed  # packed once
    with torch.no_grad():
        w.mul_(2)  # changed in place (e.g. a checkpoint loaded into it): packed again
    torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert L._PREPACKED[w] is not packed
    m = nn.Linear(96, 160).requires_grad_(False)
    linear(x, m.weight, m.bias)
    assert m.weight in L._PREPACKED
    pickle.loads(pickle.dumps(m))  # the packed copy lives outside the module, which stays picklable


@needs_onednn
def test_autograd_and_the_switch_go_around_onednn(monkeypatch):
    g = torch.Generator().manual_seed(1)
    w = nn.Parameter(torch.randn(16, 32, generator=g))  # requires grad: F.linear, which has a backward
    x = torch.randn(40, 32, generator=g)
    y = linear(x, w)
    assert y.requires_grad and torch.equal(y, F.linear(x, w)) and w not in L._PREPACKED
    y.sum().backward()
    assert w.grad is not None
    with torch.no_grad():
        assert linear(x, w) is not None and w in L._PREPACKED
    monkeypatch.setattr(L, "CPU_GEMM", "f_linear")
    v = nn.Parameter(torch.randn(16, 32, generator=g), requires_grad=False)
    assert torch.equal(linear(x[:8], v), F.linear(x[:8], v)) and v not in L._PREPACKED


def test_linear_keeps_other_dtypes_and_ranks_on_f_linear():
    x = torch.randn(4, 3, 32)
    w = torch.randn(16, 32)
    assert torch.equal(linear(x, w), F.linear(x, w))
    xh, wh = x[0].to(torch.bfloat16), w.to(torch.bfloat16)
    assert torch.equal(linear(xh, wh), F.linear(xh, wh))
