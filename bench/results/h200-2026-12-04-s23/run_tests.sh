set -u
export FLEXSPEC_CACHE_DIR=/tmp/flexspec-cache PYTHONPATH=/tmp/site:.
mkdir -p $OUT/tests $OUT/rows4
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_skinny_attention.py tests/kernels/test_skinny_linear.py tests/kernels/test_pdl.py tests/kernels/test_argmax.py -m "gpu or not gpu" > $OUT/tests/kernels.log 2>&1
echo "kernels rc=$?"; tail -2 $OUT/tests/kernels.log
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_skinny_decoder.py tests/engine/test_mixed_graphs.py tests/engine/test_async_scheduling.py tests/spec/test_deferred_context.py tests/kernels/test_attention.py tests/kernels/test_rejection.py > $OUT/tests/gpu.log 2>&1
echo "gpu rc=$?"; tail -4 $OUT/tests/gpu.log
