#!/usr/bin/env bash
# Planned for the next GPU session (not run in session 32: no device could be started): issue 6's benchmark on this
# tree (plain, always-decoupled DFlash, auto; GSM8K, MT-Bench, HumanEval; b = 1..64) with per-step logs, then
# `python -m bench.step_log_report $OUT/spec/steps.tgz` for the switch steps. Staged with scripts/device_stage.sh.
set -u
export FLEXSPEC_CACHE_DIR=/tmp/flexspec-cache PYTHONPATH=/tmp/site:.
for m in dflash flexdraft; do cp /tmp/stage/bundle/drafters/$m/model.safetensors flexspec/data/drafters/smollm2-135m-instruct-$m/; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; lscpu | grep "Model name"
mkdir -p $OUT/spec
D='"method":"dflash","model":"smollm2-135m-instruct-dflash"'
timeout ${T:-440} python3 -m bench.spec_bench --dataset gsm8k,mt_bench,humaneval --num-prompts 32 --requests-per-batch 4 \
  --batch-sizes 1,2,4,8,16,32,64 --max-tokens 128 --repeats 2 --gpu-memory-utilization 0.3 --no-progress \
  --time-budget-s ${B:-330} \
  --speculative-config "{$D,\"execution\":\"decoupled\",\"label\":\"dec\"}" \
  --speculative-config "{$D,\"label\":\"auto\"}" \
  --step-log $OUT/spec/steps --output $OUT/spec/spec_bench.json > $OUT/spec/spec_bench.log 2>&1
echo "spec_bench rc=$?"; grep "\[bench" $OUT/spec/spec_bench.log | cut -c1-160 | tail -50
cd $OUT/spec && tar czf steps.tgz steps && rm -rf steps
