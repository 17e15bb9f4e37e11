"""Session 40: the cost of SpeculationPolicy.decide on a policy trained on synthetic step times (CPU, no model).

    .venv/bin/python bench/results/h100-2026-12-06-s40/decide_cost.py
"""
import time, random
from types import SimpleNamespace
from configs import EngineConfig
from flexspec.engine.scheduler import SchedulerOutput
from flexspec.spec.policy import SpeculationPolicy
random.seed(0)
pol = SpeculationPolicy(EngineConfig(speculative_config={"method":"dflash","model":"smollm2-135m-instruct-dflash","execution":"auto"}))
pol.max_chain_drafts = 15
times = {"plain": 0.00045}
def sched(n):
    seqs=[SimpleNamespace(seq=SimpleNamespace(spec_tokens_per_step=2.0, spec_num_verifications=10, spec_estimate_weight=0.5)) for _ in range(n)]
    return SchedulerOutput(scheduled=seqs, preempted=[])
for b in (1, 64):
    s = sched(b)
    # train: every option measured at every bucket incl. switch steps
    for i in range(400):
        d = pol.decide(s)
        t = 0.00045 if d.mode == "plain" else 0.00135
        pol.observe(d.option, b, t*random.uniform(0.95,1.05), None if d.mode=="plain" else [0.5,0.25,0.1,0.05,0.02]+[0.01]*10)
        for x in s.scheduled: pol.observe_request(x.seq, 0 if d.mode=="plain" else 15, 1, d.num_speculative_tokens)
    N=20000
    t0=time.perf_counter()
    for i in range(N): pol.decide(s)
    dt=(time.perf_counter()-t0)/N*1e6
    print(f"b={b}: decide {dt:.1f} us/call; modes {pol.mode_counts}")
