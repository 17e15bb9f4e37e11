#!/usr/bin/env bash
# Session 23, H200: programmatic dependent launch (flexspec_kernels/pdl.py). Correctness first (bit-identical
# results with and without it in CUDA graphs), then decode steps of the plain engine with PDL on / off, rounds
# interleaved in one process (each engine's graphs captured with its own setting).
set -u
export FLEXSPEC_CACHE_DIR=/tmp/flexspec-cache PYTHONPATH=/tmp/site:.
mkdir -p $OUT/pdl
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_pdl.py \
  "tests/engine/test_skinny_decoder.py::test_pdl_on_gpu_gives_identical_tokens" > $OUT/pdl/pytest.log 2>&1
echo "pytest rc=$?"; tail -3 $OUT/pdl/pytest.log
timeout 300 python3 -m bench.plain_overhead --batch-sizes 1,2,4,8,16,64 --steps 300 --repeats 3 --profile-steps 20 \
  --pdl 1,0 --output $OUT/pdl/plain_overhead.json > $OUT/pdl/plain_overhead.log 2>&1
echo "plain_overhead rc=$?"; grep -v "it/s\]" $OUT/pdl/plain_overhead.log | tail -20
