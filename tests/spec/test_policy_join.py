"""``policy_tuning.ENTER_AT_JOIN``: whether speculation may start in a step where prompts join a decoding batch
(``SchedulerOutput.num_prefills``)."""

from __future__ import annotations

from types import SimpleNamespace

from flexspec.spec import policy_tuning
from tests.spec.test_policy import _policy, _sched, _train


def test_speculation_starts_at_a_step_where_prompts_join_only_if_enter_at_join(monkeypatch):
    """ENTER_AT_JOIN off: a step in which prompts join a decoding batch stays plain after plain decoding (reason
    "join"); the next pure decode step speculates; a step of prompts only, or one already speculating, is
    decided as before. On (the default): the join step speculates as any other."""
    times = {"plain": 1.0, "decoupled": 1.5, "parallel": 1.2}
    join = SimpleNamespace(scheduled=[object()] * 4, preempted=[], num_prefills=1)  # 1 prompt joins 3 decodes
    prompts_only = SimpleNamespace(scheduled=[object()] * 4, preempted=[], num_prefills=4)
    pure = SimpleNamespace(scheduled=[object()] * 4, preempted=[], num_prefills=0)
    for enter_at_join in (False, True):
        monkeypatch.setattr(policy_tuning, "ENTER_AT_JOIN", True)  # _sched's stand-ins have no token counts
        pol = _policy()
        _train(pol, 4, times, [0.9, 0.8, 0.7, 0.6])
        assert pol.decide(_sched(4)).mode == "parallel"
        monkeypatch.setattr(policy_tuning, "ENTER_AT_JOIN", enter_at_join)
        pol.last_modes = ["plain", "plain"]  # as after a plain stretch
        d = pol.decide(join)
        if enter_at_join:
            assert (d.mode, d.reason) == ("parallel", "best")
            continue
        assert (d.mode, d.reason, pol.last_reason) == ("plain", "join", "join")
        assert pol.decide(pure).mode == "parallel"  # the next pure decode step enters
        assert pol.decide(join).mode == "parallel"  # already speculating: the join step goes on
        pol.last_modes = ["plain", "plain"]
        assert pol.decide(prompts_only).mode == "parallel"  # no decoding batch to keep plain
