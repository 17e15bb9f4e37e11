"""rejection_sample: exact cases, Triton vs reference, and the emitted distribution equals p."""

import pytest
import torch

from flexspec_kernels import (
    num_emitted,
    rejection,
    rejection_sample,
    rejection_sample_ref,
    rejection_sample_triton,
)

BACKENDS = ["torch", "triton"]


def _cu(num_drafts, device="cpu"):
    cu = torch.zeros(len(num_drafts) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(num_drafts, dtype=torch.int32).cumsum(0)
    return cu.to(device)


def _run(backend, device, drafts, num_drafts, p, bonus, greedy, u, noise=None, q=None, **kw):
    """Call with python lists / CPU tensors; returns the output as a list of lists."""
    n, v = p.shape
    out = rejection_sample(
        torch.tensor(drafts, dtype=torch.int64, device=device),
        _cu(num_drafts, device),
        p.float().to(device),
        torch.tensor(bonus, dtype=torch.int64, device=device),
        torch.tensor(greedy, dtype=torch.bool, device=device),
        torch.tensor(u, dtype=torch.float32, device=device),
        (torch.ones(n, v) if noise is None else noise).float().to(device),
        None if q is None else q.float().to(device),
        backend=backend,
        **kw,
    )
    return out.tolist()


# ---------------------------------------------------------------------------------------------
# exact cases
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_deterministic_drafts(backend, device):
    # seq 0: drafts 1, 2 accepted (p(x) = 0.9, 0.6 > u), draft 3 has p(x) = 0 -> rejected,
    #        recovered = argmax of p with x zeroed (noise = 1).
    # seq 1: no drafts -> bonus only.  seq 2: one draft, accepted -> draft + bonus.
    p = torch.tensor(
        [
            [0.05, 0.9, 0.05, 0.0],
            [0.1, 0.2, 0.6, 0.1],
            [0.3, 0.5, 0.2, 0.0],
            [0.0, 0.0, 0.0, 1.0],
        ]
    )
    out = _run(backend, device, [1, 2, 3, 3], [3, 0, 1], p, [0, 2, 1], [False] * 3, [0.5, 0.5, 0.9, 0.99])
    assert out == [[1, 2, 1, -1], [2, -1, -1, -1], [3, 1, -1, -1]]
    assert num_emitted(torch.tensor(out)).tolist() == [3, 1, 2]


@pytest.mark.parametrize("backend", BACKENDS)
def test_probabilistic_drafts_threshold(backend, device):
    # p(x) / q(x) = 0.3 / 0.6 = 0.5: u = 0.49 accepts, u = 0.51 rejects.
    # Residual max(p - q, 0) = [0.4, 0, 0.1, 0] -> recovered token 0 (noise = 1).
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0]]).repeat(2, 1)
    q = torch.tensor([[0.1, 0.6, 0.1, 0.2]]).repeat(2, 1)
    out = _run(backend, device, [1, 1], [1, 1], p, [3, 3], [False, False], [0.49, 0.51], q=q)
    assert out == [[1, 3], [0, -1]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_recovered_uses_noise_race(backend, device):
    # Residual [0.4, 0, 0.1, 0]; noise makes entry 2 win: 0.1 / 0.01 > 0.4 / 1.
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    q = torch.tensor([[0.1, 0.6, 0.1, 0.2]])
    noise = torch.tensor([[1.0, 1e-6, 0.01, 1e-6]])
    out = _run(backend, device, [1], [1], p, [3], [False], [0.9], noise=noise, q=q)
    assert out == [[2, -1]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_zero_residual_falls_back_to_p(backend, device):
    # p == q and q(x) = 0 -> rejected with residual all zero -> race over p instead.
    p = torch.tensor([[0.0, 0.7, 0.3, 0.0]])
    noise = torch.tensor([[1.0, 1.0, 0.1, 1.0]])  # p / noise = [0, 0.7, 3, 0]
    out = _run(backend, device, [0], [1], p, [1], [False], [0.0], noise=noise, q=p.clone())
    assert out == [[2, -1]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy(backend, device):
    # argmax rows: 2, 0, 1. seq 0 drafts [2, 0, 2] -> accept 2, 0, reject 2 -> emit argmax 1.
    # seq 1 drafts [2, 0] -> all accepted -> bonus 3. u and q are ignored for greedy seqs.
    p = torch.tensor([[0.1, 0.2, 0.7], [0.5, 0.4, 0.1], [0.2, 0.6, 0.2], [0.1, 0.2, 0.7], [0.5, 0.4, 0.1]])
    q = torch.full((5, 3), 1.0 / 3)
    out = _run(backend, device, [2, 0, 2, 2, 0], [3, 2], p, [0, 3], [True, True], [0.99] * 5, q=q)
    assert out == [[2, 0, 1, -1], [2, 0, 3, -1]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_argmax_ties_and_long_vocab(backend, device):
    # V > the kernel's 1024-wide vocab chunk; a tie across chunks resolves to the first index.
    vocab = 2500
    p = torch.zeros(1, vocab)
    p[0, 1500] = 0.4
    p[0, 7] = 0.4
    p[0, 2400] = 0.2
    out = _run(backend, device, [1500], [1], p, [5], [True], [0.0])
    assert out == [[7, -1]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_with_larger_max_spec_len(backend, device):
    p = torch.tensor([[0.0, 1.0]])
    out = _run(backend, device, [1], [1], p, [0], [False], [0.5], max_spec_len=3)
    assert out == [[1, 0, -1, -1]]


def test_empty_batch(device):
    for fn in (rejection_sample_ref, rejection_sample_triton):
        out = fn(
            torch.zeros(0, dtype=torch.int64, device=device),
            torch.zeros(3, dtype=torch.int32, device=device),
            torch.zeros(0, 5, device=device),
            torch.tensor([4, 2], device=device),
            torch.tensor([False, True], device=device),
            torch.zeros(0, device=device),
            torch.zeros(0, 5, device=device),
        )
        assert out.tolist() == [[4], [2]]


# ---------------------------------------------------------------------------------------------
# Triton vs reference on random batches
# ---------------------------------------------------------------------------------------------


def _random_batch(num_drafts, vocab, seed, device, with_draft_probs):
    g = torch.Generator().manual_seed(seed)
    n, s = sum(num_drafts), len(num_drafts)
    logits = torch.randn(n, vocab, generator=g) * 3
    p = torch.softmax(logits, -1)
    q = torch.softmax(logits + torch.randn(n, vocab, generator=g), -1)  # close to p: long accepts
    drafts = torch.multinomial(q, 1, generator=g)[:, 0]
    args = (
        drafts.to(device),
        _cu(num_drafts, device),
        p.to(device),
        torch.randint(0, vocab, (s,), generator=g).to(device),
        (torch.rand(s, generator=g) < 0.3).to(device),
        torch.rand(n, generator=g).to(device),
        torch.empty(n, vocab).exponential_(generator=g).to(device),
        q.to(device) if with_draft_probs else None,
    )
    return args


@pytest.mark.parametrize("with_draft_probs", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_triton_matches_reference(seed, with_draft_probs, device):
    args = _random_batch(
        [3, 0, 5, 1, 4, 2, 5, 0], vocab=37, seed=seed, device=device, with_draft_probs=with_draft_probs
    )
    expected = rejection_sample_ref(*args)
    got = rejection_sample_triton(*args)
    assert torch.equal(got, expected)
    assert got.shape == (8, 6)
    assert (num_emitted(got) >= 1).all()


def test_bad_arguments_raise():
    args = list(_random_batch([2, 1], vocab=5, seed=0, device="cpu", with_draft_probs=True))
    args[1] = args[1].long()  # cu_num_draft_tokens must be int32
    for fn in (rejection_sample_ref, rejection_sample_triton):
        with pytest.raises(ValueError, match="cu_num_draft_tokens"):
            fn(*args)
    args = _random_batch([1], vocab=5, seed=0, device="cpu", with_draft_probs=True)
    with pytest.raises(ValueError, match="backend"):
        rejection_sample(*args, backend="gpu")


# ---------------------------------------------------------------------------------------------
# distribution: the first emitted token must be distributed exactly as p
# ---------------------------------------------------------------------------------------------

P = torch.tensor([0.35, 0.2, 0.15, 0.1, 0.08, 0.06, 0.04, 0.02])
Q = torch.tensor([0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.35])
CHI2_CRITICAL_DF7_P1E3 = 24.322  # chi-square quantile: df = V - 1 = 7, upper tail 1e-3


def _first_token_histogram(num_trials, backend, device, deterministic, seed=0):
    """S = num_trials sequences, each with one draft; histogram of their first emitted token."""
    g = torch.Generator().manual_seed(seed)
    vocab = P.numel()
    if deterministic:
        drafts = torch.full((num_trials,), 2, dtype=torch.int64)  # e.g. a greedy draft model
    else:
        drafts = torch.multinomial(Q, num_trials, replacement=True, generator=g)
    out = rejection_sample(
        drafts.to(device),
        _cu([1] * num_trials, device),
        P.repeat(num_trials, 1).to(device),
        torch.full((num_trials,), -7, dtype=torch.int64, device=device),  # bonus unused here
        torch.zeros(num_trials, dtype=torch.bool, device=device),
        torch.rand(num_trials, generator=g).to(device),
        torch.empty(num_trials, vocab).exponential_(generator=g).to(device),
        None if deterministic else Q.repeat(num_trials, 1).to(device),
        max_spec_len=1,
        backend=backend,
    )
    return torch.bincount(out[:, 0].cpu(), minlength=vocab).double()


def _chi_square(counts, probs=P):
    expected = counts.sum() * probs.double()
    stat = float(((counts - expected) ** 2 / expected).sum())
    try:
        from scipy.stats import chi2
    except ImportError:
        return stat, stat < CHI2_CRITICAL_DF7_P1E3
    return stat, chi2.sf(stat, df=len(probs) - 1) > 1e-3


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("backend,num_trials", [("torch", 20000), ("triton", 1000)])
def test_emitted_token_distribution_matches_target(backend, num_trials, deterministic, device):
    counts = _first_token_histogram(num_trials, backend, device, deterministic)
    stat, ok = _chi_square(counts)
    assert ok, f"chi-square {stat:.1f}: emitted histogram {counts.tolist()} does not match p"


@pytest.mark.parametrize("deterministic", [False, True])
def test_distribution_test_detects_wrong_residual(deterministic, monkeypatch):
    """Power check: sampling the recovered token from p instead of the residual must fail."""
    monkeypatch.setattr(
        rejection, "_residual", lambda target_probs, draft_probs, draft_token_ids: target_probs
    )
    counts = _first_token_histogram(20000, "torch", "cpu", deterministic)
    stat, ok = _chi_square(counts)
    assert not ok and stat > 10 * CHI2_CRITICAL_DF7_P1E3, stat


@pytest.mark.gpu
@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_triton_matches_reference_large_vocab_on_gpu(with_draft_probs):
    num_drafts = [5, 0, 3, 5, 1] * 13
    args = _random_batch(num_drafts, vocab=32000, seed=3, device="cuda", with_draft_probs=with_draft_probs)
    assert torch.equal(rejection_sample(*args), rejection_sample_ref(*args))  # auto -> Triton on CUDA
