#!/usr/bin/env bash
# Planned when no GPU was lent; its GPU tests and a reduced spec_bench A/B then ran at the end of session 31
# (../h100-2026-12-05-s31/): what the next device session should run to check and measure
# session 31's host-work changes on the GPU. Staging as in bench/results/h100-2026-12-05-s30/s30_run3.sh
# (scripts/device_stage.sh aside/pack; three calls carrying .stage/part-0{0,1,2}); then, in the last call:
set -u
export FLEXSPEC_CACHE_DIR=/tmp/flexspec-cache PYTHONPATH=/tmp/site:.
for m in dflash flexdraft; do cp /tmp/stage/bundle/drafters/$m/model.safetensors flexspec/data/drafters/smollm2-135m-instruct-$m/; done
mkdir -p $OUT/tests $OUT/spec $OUT/plain
# 1. the GPU tests of the changed paths (decode-graph staging, fused tail, async scheduling, deferred context)
timeout 250 python3 -m pytest -q -m gpu tests/spec/test_fused_verification.py tests/spec/test_deferred_context.py \
  tests/engine/test_async_scheduling.py tests/engine/test_mixed_graphs.py > $OUT/tests/gpu_tests.log 2>&1
tail -3 $OUT/tests/gpu_tests.log
# 2. plain steps: host gap and wall per step at b=1/16/64 (compare with session 30's H100 step logs / s23's H200)
timeout 150 python3 -m bench.plain_overhead --batch-sizes 64,16,1 --steps 200 --repeats 3 --profile-steps 0 \
  --speculative-config '{"method":"dflash","model":"smollm2-135m-instruct-dflash"}' --output $OUT/plain/plain_overhead.json \
  > $OUT/plain/plain_overhead.log 2>&1
# 3. spec_bench as session 30's run4 (plain / decoupled / auto, step logs): host share of decoupled steps at b=16/64
timeout 180 python3 -m bench.spec_bench --dataset gsm8k,mt_bench --num-prompts 32 --requests-per-batch 4 \
  --batch-sizes 16,64 --max-tokens 128 --repeats 2 --gpu-memory-utilization 0.3 --no-progress \
  --speculative-config '{"method":"dflash","model":"smollm2-135m-instruct-dflash","execution":"decoupled","label":"dec"}' \
  --speculative-config '{"method":"dflash","model":"smollm2-135m-instruct-dflash","label":"auto"}' \
  --step-log $OUT/spec/steps --output $OUT/spec/spec_bench.json > $OUT/spec/spec_bench.log 2>&1
cd $OUT/spec && tar czf steps.tgz steps && rm -rf steps
