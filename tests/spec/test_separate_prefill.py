"""``separate_prefill_steps``: while requests have drafts to verify, arriving prompts are prefilled in steps of
their own, so no step mixes a prompt with verification queries (those take the device-side path); outputs and
acceptance stay those of the mixed schedule."""

from __future__ import annotations

import pytest

from configs import SamplingParams
from tests.conftest import plain_outputs, real_prompts
from tests.spec.conftest import spec_engine


def _run(prompts, params, separate: bool):
    spec = {"method": "dflash", "model": "smollm2-135m-instruct-dflash", "num_speculative_tokens": 4,
            "execution": "decoupled", "separate_prefill_steps": separate}  # fmt: skip
    eng = spec_engine(spec, max_num_seqs=2)
    steps: list[tuple[int, int]] = []  # per step: (prompt chunks, verification queries)
    schedule = eng.scheduler.schedule

    def recorded():
        out = schedule()
        prefill = sum(1 for s in out.scheduled if s.num_draft_tokens == 0 and s.num_new_tokens > 1)
        steps.append((prefill, sum(1 for s in out.scheduled if s.num_draft_tokens > 0)))
        return out

    eng.scheduler.schedule = recorded
    device = {"n": 0}
    worker = eng.executor.runner.spec_worker
    on_device = worker._runs_on_device
    worker._runs_on_device = lambda inp: on_device(inp) and (device.__setitem__("n", device["n"] + 1) or True)
    outs = [o.token_ids for o in eng.generate(prompts, params)]
    return outs, eng.spec_metrics.num_accepted_tokens, steps, device["n"]


@pytest.fixture(scope="module")
def case(engine, plain_128):
    prompts = real_prompts(engine, n_each=2)  # 6 prompts through 2 slots: prompts keep arriving
    params = SamplingParams(max_tokens=10, temperature=0)
    return prompts, params, plain_outputs(plain_128, prompts, 10)


def test_separate_prefill_steps_never_mix_prompts_with_verification(case):
    prompts, params, want = case
    mixed_outs, mixed_acc, mixed_steps, mixed_dev = _run(prompts, params, separate=False)
    sep_outs, sep_acc, sep_steps, sep_dev = _run(prompts, params, separate=True)
    assert mixed_outs == sep_outs == want
    assert sep_acc == mixed_acc > 0  # the same drafts from the same histories, verified one step later
    assert any(p and v for p, v in mixed_steps), (
        "the mixed schedule puts prompts next to verification queries"
    )
    assert not any(p and v for p, v in sep_steps), sep_steps
    assert sum(p for p, _ in sep_steps) >= len(prompts)  # every prompt was prefilled
    assert sep_dev > mixed_dev  # steps the mixed schedule verified on the host now run device-side


def test_separate_prefill_is_off_by_default():
    from configs import EngineConfig

    cfg = EngineConfig(model="smollm2-135m-instruct", device="cpu",
                       speculative_config={"method": "dflash", "model": "smollm2-135m-instruct-dflash"})  # fmt: skip
    assert cfg.speculative_config.separate_prefill_steps is False
