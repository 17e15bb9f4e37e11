set -u
export FLEXSPEC_CACHE_DIR=/tmp/flexspec-cache PYTHONPATH=/tmp/site:.
for t in . old_tree; do for m in dflash flexdraft; do cp /tmp/stage/bundle/drafters/$m/model.safetensors $t/flexspec/data/drafters/smollm2-135m-instruct-$m/; done; done
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep "Model name"
mkdir -p $OUT/tests $OUT/staging
timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu tests/spec/test_fused_verification.py tests/spec/test_deferred_context.py \
  tests/engine/test_async_scheduling.py tests/engine/test_mixed_graphs.py > $OUT/tests/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; tail -4 $OUT/tests/gpu_tests.log
for r in 1 2; do
(cd old_tree && PYTHONPATH=/tmp/site:. python3 -m bench.host_staging_old --batch-sizes 1,16,64 --steps 1000 --output $OUT/staging/host_staging_d9c661e_r$r.json 2>&1 | tail -3 | cut -c 19-)
python3 -m bench.host_staging --batch-sizes 1,16,64 --steps 1000 --output $OUT/staging/host_staging_r$r.json 2>&1 | tail -3 | cut -c 19-
done
