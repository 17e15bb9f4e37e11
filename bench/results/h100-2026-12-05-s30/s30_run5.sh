set -u
export FLEXSPEC_CACHE_DIR=/tmp/flexspec-cache PYTHONPATH=/tmp/site:.
for m in dflash flexdraft; do cp /tmp/stage/bundle/drafters/$m/model.safetensors flexspec/data/drafters/smollm2-135m-instruct-$m/; done
mkdir -p $OUT/spec
D='"method":"dflash","model":"smollm2-135m-instruct-dflash"'
timeout 200 python3 -m bench.spec_bench --dataset mt_bench,gsm8k --num-prompts 32 --requests-per-batch 4 \
  --batch-sizes 16,64 --max-tokens 128 --repeats 2 --gpu-memory-utilization 0.3 --no-progress \
  --speculative-config "{$D,\"execution\":\"decoupled\",\"label\":\"dec\"}" \
  --speculative-config "{$D,\"label\":\"auto\"}" \
  --step-log $OUT/spec/steps --output $OUT/spec/spec_bench.json > $OUT/spec/spec_bench.log 2>&1
echo "spec_bench rc=$?"; grep "\[bench" $OUT/spec/spec_bench.log | cut -c1-160 | tail -30
cd $OUT/spec && tar czf steps.tgz steps && rm -rf steps
