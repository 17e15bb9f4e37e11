#!/usr/bin/env bash
# Issue 6's table on the device, with step logs: plain, DFlash k=15 and k=3 (always decoupled) and `auto`, b = 1-64,
# 3 rounds, one spec_bench process per dataset; every step's mode and the policy's reason go to OUT/t1/steps_*.
# Run on the device after `bash scripts/device_stage.sh unpack` (see that script); ~6-7 minutes on an H100.
#   OUT=/path bash scripts/issue6_table.sh                        # all three datasets
#   OUT=/path RUNS="he:humaneval:130 mt:mt_bench:140" bash scripts/issue6_table.sh   # name:dataset:timeout_s
# Then: python -m bench.table OUT/t1/he.json; python -m bench.step_log_report OUT/t1/steps_he
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to the results folder}
export FLEXSPEC_CACHE_DIR=${FLEXSPEC_CACHE_DIR:-/tmp/flexspec-cache} PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep "Model name"; uptime
D='"method":"dflash","model":"smollm2-135m-instruct-dflash"'
mkdir -p "$OUT/t1"
run() {  # name dataset timeout_s
  timeout "$3" python3 -m bench.spec_bench --dataset "$2" --num-prompts 32 --requests-per-batch 4 \
    --batch-sizes 1,2,4,8,16,32,64 --max-tokens 128 --repeats 3 --gpu-memory-utilization 0.3 --no-progress \
    --time-budget-s 300 \
    --speculative-config "{$D,\"num_speculative_tokens\":15,\"execution\":\"decoupled\",\"label\":\"k15\"}" \
    --speculative-config "{$D,\"execution\":\"decoupled\",\"num_speculative_tokens\":3,\"label\":\"k3\"}" \
    --speculative-config "{$D,\"execution\":\"auto\",\"label\":\"auto\"}" --step-log "$OUT/t1/steps_$1" \
    --output "$OUT/t1/$1.json" > "$OUT/t1/$1.log" 2>&1
  echo "== $1 $(date +%T)"; python3 -m bench.table "$OUT/t1/$1.json" 2>&1 | tail -8
}
for x in ${RUNS:-he:humaneval:130 mt:mt_bench:140 gsm:gsm8k:150}; do
  IFS=: read -r n d t <<< "$x"
  run "$n" "$d" "$t"
done
uptime
