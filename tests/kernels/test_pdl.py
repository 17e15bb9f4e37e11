"""Programmatic dependent launch (``flexspec_kernels.pdl``): when it applies, how its settings (PDL, the dot
form's preloading under it) are read, and on a Hopper GPU that a chain of dependent kernels replayed from a CUDA
graph gives bit-identical results with and without it (PDL changes when kernels start, never what they compute;
a missing wait would show as a race)."""

from __future__ import annotations

import pytest
import torch

from flexspec_kernels import pdl, skinny_linear
from flexspec_kernels._dispatch import EnvSettingError
from flexspec_kernels.argmax import argmax
from flexspec_kernels.skinny_linear import skinny_linear_triton


def test_pdl_only_on_cuda_hopper_and_later():
    assert pdl.pdl_supported((9, 0), is_hip=False, has_gdc=True)
    assert pdl.pdl_supported((10, 0), is_hip=False, has_gdc=True)
    assert not pdl.pdl_supported((8, 9), is_hip=False, has_gdc=True)  # Ada: no griddepcontrol
    assert not pdl.pdl_supported((9, 4), is_hip=True, has_gdc=True)  # ROCm (MI300 reports gfx94x as 9.4)
    assert not pdl.pdl_supported((9, 0), is_hip=False, has_gdc=False)  # a Triton without gdc_wait


@pytest.mark.parametrize(
    ("module", "attr", "var", "read"),
    [
        (pdl, "PDL", "FLEXSPEC_PDL", pdl.pdl_setting),
        (skinny_linear, "DOT_PRELOAD", "FLEXSPEC_DOT_PRELOAD", skinny_linear.dot_preload),
    ],
)
def test_pdl_settings_are_read_once_and_checked(monkeypatch, module, attr, var, read):
    monkeypatch.setattr(module, attr, None)
    monkeypatch.setenv(var, "Off")
    assert read() is False
    monkeypatch.setenv(var, "1")
    assert read() is False  # read at first use only; tests and benchmarks assign the module attribute
    monkeypatch.setattr(module, attr, None)
    monkeypatch.setenv(var, "sometimes")
    with pytest.raises(EnvSettingError, match=f"{var}='sometimes'"):
        read()
    monkeypatch.setattr(module, attr, None)
    monkeypatch.delenv(var)
    assert read() is True  # on by default


def test_no_pdl_on_cpu_or_in_the_interpreter(monkeypatch):
    monkeypatch.setattr(pdl, "PDL", True)
    assert not pdl.pdl_launch(torch.zeros(2))
    assert pdl.launch_options(False) == {} and pdl.launch_options(True) == {"launch_pdl": True}
    if torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert not pdl.pdl_launch(torch.zeros(2, device="cuda"))


def _decoder_chain(h, layers, logits_w, variant):
    """A decode step's shape: per layer norm + gate-up + SiLU, then down + residual (each launch reads the
    previous one's output), then the LM head and argmax. ``variant`` pinned: the default form depends on PDL
    (``skinny_linear.GEMV_MAX_ROWS_PDL``), and other kernels round differently."""
    for norm_w, gate_up, down in layers:
        act = skinny_linear_triton(h, gate_up, norm_weight=norm_w, activation="silu", variant=variant)
        skinny_linear_triton(act, down, residual=h, variant=variant)
    return argmax(skinny_linear_triton(h, logits_w, variant=variant).float())


@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "variant"), [(1, "gemv"), (4, "gemv"), (4, "dot")])
def test_pdl_chain_in_a_cuda_graph_is_bit_identical(rows, variant, monkeypatch):
    """PDL changes when a kernel starts, never what it computes: with the same tiles, a chain of 24 decoder
    layers replayed in a CUDA graph gives the same bits with and without it. (The dot form's weight preload,
    taken under PDL only, is one K step instead of a K loop: other rounding, hence off here; see
    ``test_preloaded_dot_chain_is_deterministic_and_keeps_the_tokens``.)"""
    if not torch.cuda.is_available() or not pdl._device_supports(torch.cuda.current_device()):
        pytest.skip("needs an sm_90+ CUDA GPU")
    monkeypatch.setattr(skinny_linear, "DOT_PRELOAD", False)
    results = _pdl_on_and_off(rows, variant, monkeypatch)
    for (h0, t0), (h1, t1) in zip(results[False], results[True]):
        assert torch.equal(h0, h1) and torch.equal(t0, t1)


@pytest.mark.gpu
def test_preloaded_dot_chain_is_deterministic_and_keeps_the_tokens(monkeypatch):
    """The dot form preloading its weights under PDL: two captures give the same bits (no read races with the
    previous kernel's writes), and the argmax tokens of every replay equal the K-loop chain without PDL (H100,
    session 29: hidden states differ by rounding only, at most 0.5 on a residual stream of |h| ~ 20)."""
    if not torch.cuda.is_available() or not pdl._device_supports(torch.cuda.current_device()):
        pytest.skip("needs an sm_90+ CUDA GPU")
    monkeypatch.setattr(skinny_linear, "DOT_PRELOAD", True)
    first = _pdl_on_and_off(4, "dot", monkeypatch)
    second = _pdl_on_and_off(4, "dot", monkeypatch, modes=(True,))
    for (h0, t0), (h1, t1), (_, t_off) in zip(first[True], second[True], first[False]):
        assert torch.equal(h0, h1) and torch.equal(t0, t1)
        assert torch.equal(t0, t_off)


def _pdl_on_and_off(rows, variant, monkeypatch, modes=(False, True)):
    """Per PDL setting in ``modes``: 40 replays of a captured 24-layer decoder chain, (hidden, tokens) each."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=g, device="cuda") * 0.05).to(torch.bfloat16)

    hidden, inter, vocab, num_layers = 576, 1536, 8192, 24
    layers = [(1 + rand(hidden), rand(2 * inter, hidden), rand(hidden, inter)) for _ in range(num_layers)]
    logits_w = rand(vocab, hidden)
    inputs = [rand(rows, hidden) * 20 for _ in range(40)]
    results = {}
    for on in modes:
        monkeypatch.setattr(pdl, "PDL", on)
        assert pdl.pdl_launch(inputs[0]) is on
        h = torch.empty_like(inputs[0])
        h.copy_(inputs[0])
        _decoder_chain(h, layers, logits_w, variant)  # compile / warm up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            tokens = _decoder_chain(h, layers, logits_w, variant)
        outs = []
        for x in inputs:  # each replay reads the new input through the whole chain
            h.copy_(x)
            graph.replay()
            outs.append((h.clone(), tokens.clone()))
        torch.cuda.synchronize()
        results[on] = outs
    return results
