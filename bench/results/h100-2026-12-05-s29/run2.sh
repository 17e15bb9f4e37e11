set -u
export FLEXSPEC_CACHE_DIR=/tmp/flexspec-cache PYTHONPATH=/tmp/site:.
mkdir -p $OUT/tests
for m in dflash flexdraft; do cp /tmp/stage/bundle/drafters/$m/model.safetensors flexspec/data/drafters/smollm2-135m-instruct-$m/; done
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 python3 .stage/ab_step.py > $OUT/ab_step.log 2>&1; echo "ab rc=$?"; cat $OUT/ab_step.log | grep -v Warn | tail -16
timeout 230 python3 -m pytest -q -p no:cacheprovider -m gpu tests/spec/test_fused_verification.py tests/engine/test_skinny_decoder.py \
  tests/engine/test_mixed_graphs.py tests/spec/test_deferred_context.py > $OUT/tests/gpu.log 2>&1
echo "gpu tests rc=$?"; tail -15 $OUT/tests/gpu.log
