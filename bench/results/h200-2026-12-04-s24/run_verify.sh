#!/usr/bin/env bash
# Session 24, H200: re-run what session 23 changed last without a GPU check (PDL on attention / argmax only up
# to 4 rows; the 4-row chain test pinned to the gemv form), then plain decode steps with PDL on / off at
# b=1-64 in one process (rounds interleaved) and engine_bench (flexspec only) with FLEXSPEC_PDL=1 and 0 to
# see whether PDL explains session 23's lower b=32 / 64 engine numbers.
set -u
export FLEXSPEC_CACHE_DIR=/tmp/flexspec-cache PYTHONPATH=/tmp/site:.
mkdir -p $OUT/tests $OUT/pdl $OUT/engine
timeout 230 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_pdl.py tests/engine/test_skinny_decoder.py \
  tests/engine/test_mixed_graphs.py tests/engine/test_async_scheduling.py tests/spec/test_deferred_context.py \
  tests/kernels/test_attention.py tests/kernels/test_rejection.py > $OUT/tests/gpu.log 2>&1
echo "gpu tests rc=$?"; tail -4 $OUT/tests/gpu.log
timeout 150 python3 -m bench.plain_overhead --batch-sizes 1,2,4,8,32,64 --steps 300 --repeats 3 --profile-steps 0 \
  --pdl 1,0 --output $OUT/pdl/plain_overhead.json > $OUT/pdl/plain_overhead.log 2>&1
echo "plain_overhead rc=$?"; grep "\[bench" $OUT/pdl/plain_overhead.log | cut -c1-220 | tail -14
MD=$(ls -d /tmp/flexspec-cache/models/smollm2-135m-instruct-*/ | head -1)
for E in 1 0; do
  FLEXSPEC_PDL=$E timeout 95 python3 -m bench.engine_bench --model-dir $MD --batch-sizes 1,8,32,64 --max-tokens 128 \
    --repeats 2 --systems flexspec --output $OUT/engine/engine_pdl$E.json > $OUT/engine/engine_pdl$E.log 2>&1
  echo "engine PDL=$E rc=$?"; grep "\[bench" $OUT/engine/engine_pdl$E.log | cut -c1-200 | tail -6
done
