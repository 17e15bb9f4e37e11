"""The split-K form of the skinny fused GEMM (``flexspec_kernels.skinny_splitk``) vs the torch reference, and
its workspace (left zero by every launch, grown outside CUDA-graph capture only)."""

import pytest
import torch

from flexspec_kernels import skinny_splitk
from flexspec_kernels.skinny_linear import MAX_ROWS, skinny_linear_ref, skinny_linear_triton
from flexspec_kernels.skinny_splitk import reserve_splitk_workspace, splitk_tiles, splitk_workspace

from .test_skinny_linear import CASES, TOL, _check_case


def _assert_workspace_clean(device):
    ws, cnt = splitk_workspace(device, 1)
    assert not ws.any() and not cnt.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, MAX_ROWS])
@pytest.mark.parametrize("case", list(CASES))
def test_splitk_matches_reference(case, rows, dtype, device):
    """Every fusion at K = 200 in chunks of 64 (4 programs per feature tile, the last over 8 of K) and N = 50
    (the last feature tile ragged too)."""
    _check_case(case, 50, 200, rows, "splitk", dtype, device, block_k=64)
    _assert_workspace_clean(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "launch",
    [{"split_k": 1}, {"split_k": 2}, {"split_k": 3}, {"split_k": 5, "block_k": 64}, {"block_k": 16}],
    ids=["split1", "split2", "split3_ragged", "split5_bk64", "bk16_split13"],
)
@pytest.mark.parametrize("case", ["norm_offset_bias", "norm_gelu", "residual_bias"])
def test_splitk_split_counts(case, launch, dtype, device):
    """Several split counts of K = 200 (a chunk of cdiv(200, split) rounded up to 16: split 3 -> 80, 80, 40),
    with and without an explicit block_k."""
    _check_case(case, 40, 200, 8, "splitk", dtype, device, **launch)
    _assert_workspace_clean(device)


def test_splitk_tiles():
    assert splitk_tiles(576, None, None) == (64, 64, 9)
    assert splitk_tiles(1536, None, None) == (128, 128, 12)
    assert splitk_tiles(200, 64, None) == (64, 64, 4)
    assert splitk_tiles(200, None, 3) == (128, 80, 3)
    assert splitk_tiles(200, None, 1) == (256, 208, 1)
    assert splitk_tiles(576, None, 6) == (128, 96, 6)
    assert splitk_tiles(40, None, 8) == (16, 16, 3)  # fewer chunks than asked: 16 of K at least per program
    with pytest.raises(ValueError, match="smaller than a chunk"):
        splitk_tiles(200, 32, 2)
    with pytest.raises(ValueError, match="power of 2"):
        splitk_tiles(200, 48, None)
    with pytest.raises(ValueError, match="split_k must be"):
        splitk_tiles(200, None, 0)


@pytest.mark.parametrize("activation", [None, "silu"])
def test_splitk_repeated_calls_agree(activation, device):
    """Two launches in a row give the same output: the first left the workspace sums and counters zero (on a
    GPU the fp32 atomics' order may move the last bits, so exactness is asked of the interpreter only)."""
    g = torch.Generator().manual_seed(5)
    n, k, dtype = (96 if activation else 48), 200, torch.bfloat16
    x = torch.randn(8, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(device, dtype)
    nw = (1 + 0.3 * torch.randn(k, generator=g)).to(device, dtype)
    kw = {"norm_weight": nw, "activation": activation, "variant": "splitk", "block_k": 64}
    first = skinny_linear_triton(x, w, **kw)
    second = skinny_linear_triton(x, w, **kw)
    if device.type == "cpu":
        assert torch.equal(first, second)
    else:
        torch.testing.assert_close(first, second, **TOL[dtype])
    torch.testing.assert_close(
        second, skinny_linear_ref(x, w, norm_weight=nw, activation=activation), **TOL[dtype]
    )
    _assert_workspace_clean(device)


def test_splitk_workspace_grows_and_keeps_old_buffers(device):
    """A GEMM wider than the workspace grows it (the outgrown buffers stay alive for graphs captured earlier);
    a reserved workspace is reused."""
    g = torch.Generator().manual_seed(6)
    ws0, cnt0 = reserve_splitk_workspace(device, 4, 32)
    assert ws0.numel() >= MAX_ROWS * 32 and cnt0.numel() >= 2 and ws0.dtype == torch.float32
    assert reserve_splitk_workspace(device, MAX_ROWS, 32)[0] is ws0
    n = ws0.numel() // MAX_ROWS + 16  # wider than what is there
    x = torch.randn(3, 64, generator=g).to(device)
    w = (torch.randn(n, 64, generator=g) * 0.125).to(device)
    got = skinny_linear_triton(x, w, variant="splitk", block_k=16)
    torch.testing.assert_close(got, skinny_linear_ref(x, w), **TOL[torch.float32])
    ws1, cnt1 = splitk_workspace(device, 1)
    assert ws1.numel() >= MAX_ROWS * n and cnt1.numel() >= n // 16
    assert any(old[0] is ws0 for old in skinny_splitk._RETIRED)
    _assert_workspace_clean(device)
    with pytest.raises(ValueError, match="max_rows"):
        reserve_splitk_workspace(device, MAX_ROWS + 1, 32)


def test_splitk_workspace_does_not_grow_during_graph_capture(monkeypatch):
    """Growing allocates: refused while the current CUDA stream captures (checked without a GPU: the capture
    flag faked, the device never touched since the check comes first)."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    dev = torch.device("cuda", 15)
    monkeypatch.delitem(skinny_splitk._WORKSPACES, dev, raising=False)
    with pytest.raises(RuntimeError, match="reserve_splitk_workspace"):
        splitk_workspace(dev, 3072)


def test_splitk_errors(device):
    x, w = torch.randn(3, 32, device=device), torch.randn(24, 32, device=device)
    with pytest.raises(ValueError, match="block_n must be"):
        skinny_linear_triton(x, w, variant="splitk", block_n=8)
    with pytest.raises(ValueError, match="split_k applies"):
        skinny_linear_triton(x, w, variant="dot", split_k=2)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 16])
def test_splitk_in_a_cuda_graph_with_pdl(rows, monkeypatch):
    """Split-K GEMMs back to back in a CUDA graph, sharing the one workspace, with PDL where the GPU has it
    (sm_90+): QKV + norm, gate-up + norm + SiLU, then down + residual reading the gate-up's output (the
    workspace's reuse and the read of the previous grid's output both ordered by the PDL wait). Each of 20
    replays on new inputs matches the reference of that replay's inputs, and leaves the workspace zero."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from flexspec_kernels import pdl

    monkeypatch.setattr(pdl, "PDL", True)
    g = torch.Generator(device="cuda").manual_seed(0)
    dtype, hidden, inter = torch.bfloat16, 576, 1536

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)

    nw = 1 + rand(hidden, scale=0.1)
    qkv, gate_up = rand(960, hidden, scale=hidden**-0.5), rand(2 * inter, hidden, scale=hidden**-0.5)
    down = rand(hidden, inter, scale=inter**-0.5)
    x, h = rand(rows, hidden), rand(rows, hidden)

    def step():
        q = skinny_linear_triton(x, qkv, norm_weight=nw, variant="splitk")
        act = skinny_linear_triton(x, gate_up, norm_weight=nw, activation="silu", variant="splitk")
        skinny_linear_triton(act, down, residual=h, variant="splitk")
        return q, act

    step()  # compiles and sizes the workspace outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, act = step()
    for _ in range(20):
        xi, hi = rand(rows, hidden), rand(rows, hidden)
        x.copy_(xi)
        h.copy_(hi)
        graph.replay()
        torch.testing.assert_close(q, skinny_linear_ref(xi, qkv, norm_weight=nw), **TOL[dtype])
        want_act = skinny_linear_ref(xi, gate_up, norm_weight=nw, activation="silu")
        torch.testing.assert_close(act, want_act, **TOL[dtype])
        torch.testing.assert_close(h, skinny_linear_ref(act, down, residual=hi.clone()), **TOL[dtype])
    torch.cuda.synchronize()
    _assert_workspace_clean(torch.device("cuda", torch.cuda.current_device()))
