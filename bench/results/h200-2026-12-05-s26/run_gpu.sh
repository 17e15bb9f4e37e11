#!/usr/bin/env bash
# Session 26, H200: the full `-m gpu` test set with a limit that lets it finish (session 24's was cut at 230 s).
set -u
export FLEXSPEC_CACHE_DIR=/tmp/flexspec-cache PYTHONPATH=/tmp/site:.
mkdir -p $OUT/tests
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/tests/gpu_name.txt
timeout ${T:-520} python3 -m pytest -q -p no:cacheprovider -m gpu --durations=0 tests/kernels/test_pdl.py tests/engine/test_skinny_decoder.py \
  tests/engine/test_mixed_graphs.py tests/engine/test_async_scheduling.py tests/spec/test_deferred_context.py \
  tests/kernels/test_attention.py tests/kernels/test_rejection.py > $OUT/tests/gpu.log 2>&1
echo "gpu tests rc=$?"; grep -E "passed|failed|error" $OUT/tests/gpu.log | tail -5
