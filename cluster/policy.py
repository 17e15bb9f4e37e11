"""Execution policy: chooses, once per engine step, how the batch runs (DESIGN.md section 3, last paragraph).

Modes:
    plain      autoregressive decoding, one token per sequence per step (no drafts).
    decoupled  verify the K drafts, then run the drafter over the accepted branch (every method).
    parallel   FlexDraft only: draft and verify in one target forward (O(B^2) tokens per sequence).

The decision is made in one place (the replica's controller loop calls ``choose`` once per step) and travels
inside the step's ``ModelInput`` to every TP rank, so ranks never disagree. The FlexDraft issue replaces
``DefaultExecutionPolicy`` with the cost model: maximise E[emitted tokens | acceptance stats] / step time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

ExecutionMode = Literal["plain", "decoupled", "parallel"]


@dataclass(frozen=True)
class BatchView:
    """What the policy may look at before a step (cheap host-side numbers only; no device syncs)."""

    num_running: int  # sequences already decoding or prefilling
    num_waiting: int  # queued sequences not yet admitted
    kv_cache_usage: float  # fraction of KV blocks in use, [0, 1]


@dataclass(frozen=True)
class ExecutionDecision:
    """The one decision broadcast to every rank for a step."""

    mode: ExecutionMode
    num_speculative_tokens: int = 0  # drafts to verify per sequence (0 in plain mode)


class ExecutionPolicy(Protocol):
    def choose(self, batch: BatchView) -> ExecutionDecision: ...


class DefaultExecutionPolicy:
    """Static choice: decoupled speculation when a ``speculative_config`` is set, plain decoding otherwise.

    Honours ``execution`` ("parallel" / "decoupled" force a mode; "auto" means decoupled until the cost model
    lands) and ``disable_by_batch_size`` (plain when more sequences than that are running), as vLLM does.
    """

    def __init__(self, speculative_config: object | None) -> None:
        self.spec = speculative_config

    def choose(self, batch: BatchView) -> ExecutionDecision:
        spec = self.spec
        if spec is None:
            return ExecutionDecision("plain")
        limit = getattr(spec, "disable_by_batch_size", None)
        if limit is not None and batch.num_running > limit:
            return ExecutionDecision("plain")
        mode: ExecutionMode = "parallel" if getattr(spec, "execution", "auto") == "parallel" else "decoupled"
        return ExecutionDecision(mode, int(getattr(spec, "num_speculative_tokens", 0)))
