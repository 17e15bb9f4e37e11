"""A sequence's tokens, KV-cache blocks and progress through the engine."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from configs.sampling import SamplingParams

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


class Sequence:
    """One generation stream: prompt tokens, output tokens and the KV blocks holding their keys/values.

    ``num_computed_tokens`` counts tokens whose K/V are in the cache; the scheduler asks the runner to
    compute the next chunk ``token_ids[num_computed_tokens : num_computed_tokens + n]``.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
        *,
        max_model_len: int | None,
        eos_token_ids: Iterable[int],
    ) -> None:
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.prompt_token_ids: list[int] = list(prompt_token_ids)  # shared by every output (read-only)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.params = params
        # Derived once from the (frozen) params, read on every step by the engine's hot loops:
        # the length at which the sequence stops (max_tokens, capped by max_model_len) ...
        max_len = self.num_prompt_tokens + params.max_tokens
        self.max_len = max_len if max_model_len is None else min(max_len, max_model_len)
        # ... the token ids that end it: the model's EOS ids as the engine knew them when the request was added
        # (none with ignore_eos), and the request's stop token ids ...
        self.eos_token_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.stop_token_set = frozenset(params.stop_token_ids) | self.eos_token_ids
        # ... and how many trailing characters of its text streaming holds back (a stop string could start there)
        self.stop_text_hold = max((len(s) - 1 for s in params.stop), default=0)
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.logprobs: list[TokenLogprob] = []
        self.output_text = ""
        self.num_text_sent = 0  # chars of output_text already streamed
        self.num_preemptions = 0
        # Sampling noise is derived from (seed, output position): stateless, so it survives preemption and
        # is identical on whichever process samples. Unseeded requests get a seed from the engine.
        self.seed = params.seed if params.seed is not None else seed
        # Speculative decoding: draft tokens proposed for the next step (not yet verified).
        self.draft_token_ids: list[int] = []
        # their tree (``flexspec.spec.tree``: draft i continues draft parents[i], -1 = the last token); None = a chain
        self.draft_parents: list[int] | None = None
        self.draft_length = 0  # the most drafts the policy allowed when draft_token_ids were proposed
        self.spec_tokens_per_step: float | None = None  # this request's running MAL (speculation policy)
        self.spec_estimate_weight = 1.0  # its weight against the policy's prior: decays while not verified
        self.spec_num_verifications = 0  # verification steps behind spec_tokens_per_step

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens
