"""``SchedulerOutput.num_prefills``: the scheduled sequences that compute prompt tokens (a prompt joining the
batch, a chunked prompt going on), read by the speculation policy (``ENTER_AT_JOIN``); decode steps count none."""

from __future__ import annotations

from configs import EngineConfig, SamplingParams
from flexspec.engine.block_manager import BlockManager
from flexspec.engine.scheduler import Scheduler
from flexspec.engine.sequence import Sequence


def _seq(n: int) -> Sequence:
    return Sequence(
        "r", list(range(1, n + 1)), SamplingParams(max_tokens=8), 0, max_model_len=512, eos_token_ids=[0]
    )


def _step(sched: Scheduler):
    """Schedule one step and apply it: every scheduled chunk computed, one token sampled where it samples."""
    out = sched.schedule()
    for s in out.scheduled:
        seq = s.seq
        sampled = s.samples
        seq.num_computed_tokens += s.num_new_tokens
        if sampled:
            seq.token_ids.append(7)
    return out


def test_num_prefills_counts_prompts_joining_and_chunks_going_on():
    config = EngineConfig(
        model="smollm2-135m-instruct", device="cpu", max_model_len=512, max_num_seqs=4,
        max_num_batched_tokens=64, enable_chunked_prefill=True,
    )  # fmt: skip
    sched = Scheduler(config, BlockManager(num_blocks=64, block_size=16))
    a, b = _seq(10), _seq(100)
    sched.add(a)
    out = _step(sched)
    assert out.num_prefills == 1 and not out.is_pure_decode  # a's prompt
    out = _step(sched)
    assert out.num_prefills == 0 and out.is_pure_decode  # a decodes
    sched.add(b)
    out = _step(sched)  # a decodes, b's first chunk of 63 tokens joins (budget 64)
    assert out.num_prefills == 1 and len(out.scheduled) == 2
    out = _step(sched)  # a decodes, b's prompt goes on (its second chunk)
    assert out.num_prefills == 1 and [s.num_new_tokens for s in out.scheduled] == [1, 37]
    out = _step(sched)
    assert out.num_prefills == 0 and out.is_pure_decode
