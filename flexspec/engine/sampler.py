"""Token sampling: temperature, top-k, top-p, per-request seeds, logprobs.

Sampling uses the exponential race (argmax of p_i / E_i with E_i ~ Exp(1) draws token i with probability
p_i), so one kernel-friendly argmax replaces ``torch.multinomial`` and never syncs with the host. Noise for a
seeded row is drawn from a generator seeded by (request seed, output position): stateless, reproducible
across preemption, batching and processes.
"""

from __future__ import annotations

from functools import cached_property

import torch

from flexspec_kernels.argmax import argmax

_SEED_STRIDE = 1_000_003


class SamplingMetadata:
    """Per logits row, N rows. Host lists; the device tensors are built on first use, so an all-greedy step
    (argmax only) copies nothing to the device.

    Args:
        rows: ``(temperature, top_p, top_k, seed, offset)`` per row; temperature 0 = greedy, top_k <= 0 =
            disabled, offset = the row's output position (its noise stream index).
        device: where the tensors go.
        max_num_logprobs: max top-logprobs over rows; None = no logprobs requested by any row.
    """

    def __init__(
        self,
        rows: list[tuple[float, float, int, int, int]],
        device: torch.device,
        max_num_logprobs: int | None = None,
    ) -> None:
        self.rows = rows
        self.device = device
        self.max_num_logprobs = max_num_logprobs
        # the only field a greedy step reads (one pass over N rows; the others are computed when asked: a
        # verification step at batch 64 has ~1000 rows)
        self.all_greedy = all(r[0] == 0.0 for r in rows)

    @cached_property
    def seeds(self) -> list[int]:  # [N]
        return [r[3] for r in self.rows]

    @cached_property
    def offsets(self) -> list[int]:  # [N]
        return [r[4] for r in self.rows]

    @cached_property
    def any_greedy(self) -> bool:
        return any(r[0] == 0.0 for r in self.rows)

    @cached_property
    def need_top_k(self) -> bool:
        return any(r[2] > 0 for r in self.rows)

    @cached_property
    def need_top_p(self) -> bool:
        return any(r[1] < 1.0 for r in self.rows)

    def _column(self, i: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([r[i] for r in self.rows], dtype=dtype).to(self.device, non_blocking=True)

    @cached_property
    def temperature(self) -> torch.Tensor:  # [N] float32; 0 = greedy
        return self._column(0, torch.float32)

    @cached_property
    def top_p(self) -> torch.Tensor:  # [N] float32
        return self._column(1, torch.float32)

    @cached_property
    def top_k(self) -> torch.Tensor:  # [N] int64; <= 0 = disabled
        return self._column(2, torch.int64)

    def select(self, rows: list[int]) -> SamplingMetadata:
        """The metadata of a subset of rows (e.g. the bonus rows of a verification step)."""
        return SamplingMetadata([self.rows[r] for r in rows], self.device)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, need_k: bool = True, need_p: bool = True
) -> torch.Tensor:
    """Mask logits [N, V] outside each row's top-k / top-p (nucleus, Holtzman et al. 1904.09751) to -inf.

    ``need_k`` / ``need_p`` (host flags) skip the sort when no row uses them.
    """
    if not (need_k or need_p):
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    V = logits.shape[-1]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if need_k:
        k = torch.where(top_k > 0, top_k.clamp(max=V), V)  # [N]
        ranks = torch.arange(V, device=logits.device).unsqueeze(0)
        remove |= ranks >= k.unsqueeze(1)
    if need_p:
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        cum = probs.cumsum(dim=-1)
        # Remove a token if the mass before it already reaches top_p; the top token always stays (a top_p
        # that rounds to 0 in float32, e.g. 1e-300, would remove it too and leave nothing to sample).
        remove |= (cum - probs) >= top_p.unsqueeze(1)
        remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def target_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution a row samples from: softmax(top_k_top_p(logits / T)), [N, V] float32.

    Greedy rows (T = 0) get a one-hot at their argmax.
    """
    temp = torch.where(meta.temperature > 0, meta.temperature, 1.0).unsqueeze(1)
    probs = apply_top_k_top_p(
        logits.float() / temp, meta.top_k, meta.top_p, meta.need_top_k, meta.need_top_p
    ).softmax(dim=-1)
    if not meta.all_greedy and meta.any_greedy:
        greedy = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(probs.dtype)
        probs = torch.where((meta.temperature == 0).unsqueeze(1), greedy, probs)
    elif meta.all_greedy:
        probs = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(probs.dtype)
    return probs


def exponential_noise(shape: tuple[int, int], meta: SamplingMetadata, device: torch.device) -> torch.Tensor:
    """Exp(1) noise [N, V]; row i comes from a generator seeded by (seeds[i], offsets[i])."""
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    for i, (seed, offset) in enumerate(zip(meta.seeds, meta.offsets)):
        gen = torch.Generator(device=device).manual_seed(
            (seed * _SEED_STRIDE + offset) & 0x7FFF_FFFF_FFFF_FFFF
        )
        noise[i].exponential_(generator=gen)
    return noise


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """logits [N, V] -> token ids [N] int64. Greedy rows take argmax; others sample from ``target_probs``."""
    if meta.all_greedy:
        return argmax(logits)
    probs = target_probs(logits, meta)
    noise = exponential_noise(tuple(probs.shape), meta, logits.device)
    sampled = argmax(probs / noise)
    return torch.where(meta.temperature == 0, argmax(logits), sampled)


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of the model's raw distribution (vLLM's default ``raw_logprobs`` semantics).

    Returns (chosen logprob [N], top logprobs [N, num_top], top token ids [N, num_top]).
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    top_vals, top_ids = (
        logp.topk(num_top, dim=-1) if num_top > 0 else (logp[:, :0], token_ids[:, None][:, :0])
    )
    return chosen, top_vals, top_ids


def attach_logprobs(
    out,  # ModelOutput
    logits: torch.Tensor,
    first_rows: list[int],
    num_top: int,
    rows: list[int] | None = None,
) -> None:
    """Fill ``out.logprobs`` / ``out.top_logprobs``: emitted token j of sequence i was chosen from logits row
    ``first_rows[i] + j`` (logits [N, V]), or from ``rows`` (the emitted tokens' rows, flattened) when given
    (draft trees)."""
    if rows is None:
        rows = [r0 + j for r0, toks in zip(first_rows, out.token_ids) for j in range(len(toks))]
    flat = [t for toks in out.token_ids for t in toks]
    idx = torch.tensor(rows, device=logits.device)
    chosen, top_vals, top_ids = compute_logprobs(
        logits[idx], torch.tensor(flat, device=logits.device), num_top
    )
    chosen_l, vals_l, ids_l = chosen.tolist(), top_vals.tolist(), top_ids.tolist()
    out.logprobs, out.top_logprobs = [], []
    k = 0
    for toks in out.token_ids:
        out.logprobs.append(chosen_l[k : k + len(toks)])
        out.top_logprobs.append([list(zip(ids_l[r], vals_l[r])) for r in range(k, k + len(toks))])
        k += len(toks)
