#!/usr/bin/env bash
# Session 46, call A: in-process A/B of HOLD_PLAIN_FROM (auto: 1; plain16: 16, told apart by an explicit
# draft_lengths equal to the default) with plain decoding, b = 1-8, three datasets; then issue 6's GSM8K table.
set -uo pipefail
export FLEXSPEC_CACHE_DIR=/tmp/flexspec-cache PYTHONPATH=/tmp/site:.
D='"method":"dflash","model":"smollm2-135m-instruct-dflash","execution":"auto"'
for m in dflash flexdraft; do cp /tmp/stage/bundle/drafters/$m/model.safetensors flexspec/data/drafters/smollm2-135m-instruct-$m/; done
tail -2 /tmp/unpack.log; python3 -m flexspec.cli prepare-model smollm2-135m-instruct 2>&1 | tail -1
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep "Model name"; git log --oneline -1 2>/dev/null
rm -rf /tmp/r; mkdir -p /tmp/r
mkdir -p $OUT/prof
timeout 100 python3 scripts/profile_spec_step.py null 1,8 $OUT/prof/plain.json > $OUT/prof/plain.log 2>&1; echo prof plain rc=$?
timeout 100 python3 scripts/profile_spec_step.py '{"method":"dflash","model":"smollm2-135m-instruct-dflash","execution":"decoupled"}' 1,8 $OUT/prof/k15.json $OUT/prof/trace15 > $OUT/prof/k15.log 2>&1; echo prof k15 rc=$?
timeout 100 python3 scripts/profile_spec_step.py '{"method":"dflash","model":"smollm2-135m-instruct-dflash","execution":"decoupled","num_speculative_tokens":7}' 1 $OUT/prof/k7.json > $OUT/prof/k7.log 2>&1; echo prof k7 rc=$?
tail -25 $OUT/prof/k15.log
run() {  # name dataset
  timeout 120 python3 - --dataset "$2" --num-prompts 32 --requests-per-batch 4 \
    --batch-sizes 1,2,4,8 --max-tokens 128 --repeats 3 --gpu-memory-utilization 0.25 --no-progress --time-budget-s 100 \
    --speculative-config "{$D,\"label\":\"auto\"}" \
    --speculative-config "{$D,\"draft_lengths\":[3,7,15],\"label\":\"plain16\"}" --step-log /tmp/r/steps_$1 \
    --output /tmp/r/$1.json > /tmp/r/$1.log 2>&1 <<'PY'
import runpy, sys
from flexspec.spec import policy, policy_tuning
decide = policy.SpeculationPolicy.decide
def held_or_not(self, sched):
    policy_tuning.HOLD_PLAIN_FROM = 16 if self.spec.draft_lengths is not None else 1
    return decide(self, sched)
policy.SpeculationPolicy.decide = held_or_not
sys.argv = ["bench.spec_bench", *sys.argv[1:]]
runpy.run_module("bench.spec_bench", run_name="__main__")
PY
  echo "== $1 $(date +%T) rc=$?"; python3 -m bench.table /tmp/r/$1.json 2>&1 | tail -6; python3 -c "
import json; d=json.load(open('/tmp/r/$1.json'))
for x in d['runs']:
  if x['system']!='plain': print(x['system'], x['batch_size'], [round(r,3) for r in x.get('paired_ratios') or []], x.get('paired_ratio_median'), x['matches_plain'])"
}
run mt mt_bench; run gsm gsm8k
tar cJf $OUT/ab.tar.xz -C /tmp r
rm -rf /tmp/t; OUT2=$OUT; OUT=/tmp/t RUNS="gsm:gsm8k:170" bash scripts/issue6_table.sh
tar cJf $OUT2/table_gsm.tar.xz -C /tmp t
