#!/usr/bin/env bash
# b=1 GSM8K: auto's host work per step, this tree (new) against 205af5c (old, session 44's table-final code)
set -uo pipefail
export FLEXSPEC_CACHE_DIR=/tmp/flexspec-cache
R=$(pwd)
for m in dflash flexdraft; do for d in flexspec .stage/old/flexspec; do cp /tmp/stage/bundle/drafters/$m/model.safetensors $d/data/drafters/smollm2-135m-instruct-$m/; done; done
PYTHONPATH=/tmp/site:. python3 -m flexspec.cli prepare-model smollm2-135m-instruct 2>&1 | tail -1
mkdir -p /tmp/p
D='"method":"dflash","model":"smollm2-135m-instruct-dflash"'
run() {  # tag dir
  (cd $2 && PYTHONPATH=.:/tmp/site:$R timeout 90 python3 -m bench.spec_bench --dataset gsm8k --num-prompts 8 --requests-per-batch 1 \
    --batch-sizes 1 --max-tokens 128 --repeats 3 --gpu-memory-utilization 0.3 --no-progress \
    --speculative-config "{$D,\"num_speculative_tokens\":15,\"execution\":\"decoupled\",\"label\":\"k15\"}" \
    --speculative-config "{$D,\"execution\":\"auto\",\"label\":\"auto\"}" --step-log /tmp/p/steps_$1 \
    --output /tmp/p/$1.json > /tmp/p/$1.log 2>&1)
  echo "== $1 $(date +%T)"; grep -m1 "flexspec/__init__\|tree" /tmp/p/$1.log; PYTHONPATH=/tmp/site:. python3 -m bench.step_log_report /tmp/p/steps_$1 2>&1 | grep "steady\|jsonl" | cut -c17-
}
run old .stage/old; run new .
tar cJf $OUT/p.tar.xz -C /tmp p
