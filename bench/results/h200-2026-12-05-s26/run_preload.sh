#!/usr/bin/env bash
# Session 26, H200: the dot-form skinny GEMM with its weights preloaded before the PDL wait (FLEXSPEC_DOT_PRELOAD).
set -u
export FLEXSPEC_CACHE_DIR=/tmp/flexspec-cache PYTHONPATH=/tmp/site:.
for m in dflash flexdraft; do cp /tmp/stage/bundle/drafters/$m/model.safetensors flexspec/data/drafters/smollm2-135m-instruct-$m/; done
mkdir -p $OUT/preload
timeout 100 python3 bench/results/h200-2026-12-05-s26/tune_preload.py > $OUT/preload/tune.log 2>&1; echo "tune rc=$?"; grep "preload=" $OUT/preload/tune.log | cut -c1-330
timeout 150 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/kernels/test_skinny_linear.py tests/kernels/test_pdl.py > $OUT/preload/kernel_tests.log 2>&1; echo "kernel tests rc=$?"; tail -2 $OUT/preload/kernel_tests.log
for E in 1 0; do
  FLEXSPEC_DOT_PRELOAD=$E timeout 100 python3 -m bench.plain_overhead --batch-sizes 1,8,16 --steps 200 --repeats 2 --profile-steps 0 \
    --output $OUT/preload/plain_overhead_$E.json > $OUT/preload/plain_overhead_$E.log 2>&1
  echo "plain_overhead preload=$E rc=$?"; grep "\[bench" $OUT/preload/plain_overhead_$E.log | cut -c1-200 | tail -4
done
for E in 1 0; do
  FLEXSPEC_DOT_PRELOAD=$E timeout 100 python3 -m bench.spec_bench --dataset gsm8k --num-prompts 32 --requests-per-batch 4 \
    --batch-sizes 1 --max-tokens 128 --repeats 2 --gpu-memory-utilization 0.3 --no-progress \
    --speculative-config '{"method":"dflash","model":"smollm2-135m-instruct-dflash","execution":"decoupled","label":"dec"}' \
    --output $OUT/preload/spec_$E.json > $OUT/preload/spec_$E.log 2>&1
  echo "spec preload=$E rc=$?"; grep "\[bench" $OUT/preload/spec_$E.log | cut -c1-160 | tail -3
done
