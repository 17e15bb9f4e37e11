#!/usr/bin/env bash
# Session 24, H200: after PDL made the plain step cheaper (b=1 0.44 ms), (1) GPU tests with a longer limit
# than the first call's, (2) plain steps of the DFlash engine held on plain decoding vs the plain engine
# (bench.plain_overhead), (3) spec_bench GSM8K + MT-Bench, DFlash decoupled / auto vs plain.
set -u
export FLEXSPEC_CACHE_DIR=/tmp/flexspec-cache PYTHONPATH=/tmp/site:.
mkdir -p $OUT/tests $OUT/overhead $OUT/spec
case "${1:-}" in
  tests)
    timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_pdl.py tests/engine/test_skinny_decoder.py \
      tests/engine/test_mixed_graphs.py tests/engine/test_async_scheduling.py tests/spec/test_deferred_context.py \
      tests/kernels/test_attention.py tests/kernels/test_rejection.py > $OUT/tests/gpu.log 2>&1
    echo "gpu tests rc=$?"; tail -4 $OUT/tests/gpu.log
    timeout 150 python3 -m bench.plain_overhead --batch-sizes 1,4,16,64 --steps 300 --repeats 3 --profile-steps 0 \
      --speculative-config '{"method":"dflash","model":"smollm2-135m-instruct-dflash"}' \
      --output $OUT/overhead/plain_overhead.json > $OUT/overhead/plain_overhead.log 2>&1
    echo "plain_overhead rc=$?"; grep "\[bench" $OUT/overhead/plain_overhead.log | cut -c1-200 | tail -8 ;;
  spec)
    for m in dflash flexdraft; do cp /tmp/stage/bundle/drafters/$m/model.safetensors flexspec/data/drafters/smollm2-135m-instruct-$m/; done
    timeout 560 python3 -m bench.spec_bench --dataset gsm8k,mt_bench --num-prompts 32 --requests-per-batch 4 \
      --batch-sizes 1,4,16,64 --max-tokens 128 --repeats 2 --gpu-memory-utilization 0.3 --no-progress \
      --speculative-config '{"method":"dflash","model":"smollm2-135m-instruct-dflash","execution":"decoupled","label":"dec"}' \
      --speculative-config '{"method":"dflash","model":"smollm2-135m-instruct-dflash","label":"auto"}' \
      --output $OUT/spec/spec_bench.json > $OUT/spec/spec_bench.log 2>&1
    echo "spec_bench rc=$?"; grep "\[bench" $OUT/spec/spec_bench.log | cut -c1-180 | tail -30 ;;
esac
