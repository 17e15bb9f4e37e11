#!/usr/bin/env bash
set -uo pipefail
export FLEXSPEC_CACHE_DIR=/tmp/flexspec-cache PYTHONPATH=/tmp/site:.
D='"method":"dflash","model":"smollm2-135m-instruct-dflash"'
for m in dflash flexdraft; do cp /tmp/stage/bundle/drafters/$m/model.safetensors flexspec/data/drafters/smollm2-135m-instruct-$m/; done
mkdir -p /tmp/r
run() {  # name dataset tag price_exit
  python3 - "$4" --dataset "$2" --num-prompts 32 --requests-per-batch 4 \
    --batch-sizes 16,32,64 --max-tokens 128 --repeats 3 --gpu-memory-utilization 0.3 --no-progress --time-budget-s 100 \
    --speculative-config "{$D,\"execution\":\"auto\",\"label\":\"auto\"}" --step-log /tmp/r/steps_$1_$3 \
    --output /tmp/r/$1_$3.json > /tmp/r/$1_$3.log 2>&1 <<'PY'
import runpy, sys
from flexspec.spec import policy_tuning
policy_tuning.PRICE_EXIT_FOLLOWER = sys.argv[1] == "1"
sys.argv = ["bench.spec_bench", *sys.argv[2:]]
runpy.run_module("bench.spec_bench", run_name="__main__")
PY
  echo "== $1 $3 $(date +%T) rc=$?"; python3 -c "
import json; d=json.load(open('/tmp/r/$1_$3.json'))
for x in d['runs']:
  if x['system']=='auto': print(x['batch_size'], [round(r,3) for r in x.get('paired_ratios') or []], x.get('paired_ratio_median'), x['matches_plain'])"
}
run gsm gsm8k new 1; run gsm gsm8k old 0; run he humaneval new 1; run he humaneval old 0
tar cJf $OUT/ab.tar.xz -C /tmp r
