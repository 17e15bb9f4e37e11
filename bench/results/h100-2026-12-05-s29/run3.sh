set -u
export FLEXSPEC_CACHE_DIR=/tmp/flexspec-cache PYTHONPATH=/tmp/site:.
mkdir -p $OUT/spec
for m in dflash flexdraft; do cp /tmp/stage/bundle/drafters/$m/model.safetensors flexspec/data/drafters/smollm2-135m-instruct-$m/; done
timeout 110 python3 -m pytest -q -p no:cacheprovider -m gpu tests/spec/test_fused_verification.py 2>&1 | tail -3
timeout 400 python3 -m bench.spec_bench --dataset gsm8k,mt_bench --num-prompts 16 --requests-per-batch 4 \
  --batch-sizes 1,4,16,64 --max-tokens 128 --repeats 1 --gpu-memory-utilization 0.3 --no-progress \
  --speculative-config '{"method":"dflash","model":"smollm2-135m-instruct-dflash","execution":"decoupled","label":"dec"}' \
  --speculative-config '{"method":"dflash","model":"smollm2-135m-instruct-dflash","label":"auto"}' \
  --output $OUT/spec/spec_bench.json > $OUT/spec/spec_bench.log 2>&1
echo "spec_bench rc=$?"; grep "\[bench" $OUT/spec/spec_bench.log | cut -c1-180 | tail -30
