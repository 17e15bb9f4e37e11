for m in dflash flexdraft; do cp /tmp/stage/bundle/drafters/$m/model.safetensors flexspec/data/drafters/smollm2-135m-instruct-$m/; done
export FLEXSPEC_CACHE_DIR=/tmp/flexspec-cache PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name --format=csv,noheader
D='"method":"dflash","model":"smollm2-135m-instruct-dflash"'
for ds in "$@"; do
mkdir -p $OUT/$ds
timeout 280 python3 -m bench.spec_bench --dataset $ds --num-prompts 32 --requests-per-batch 4 --batch-sizes 1,2,4,8,16,32,64 \
  --max-tokens 128 --repeats 2 --gpu-memory-utilization 0.3 --no-progress --time-budget-s 200 \
  --speculative-config "{$D,\"execution\":\"decoupled\",\"label\":\"k15\"}" \
  --speculative-config "{$D,\"execution\":\"decoupled\",\"num_speculative_tokens\":3,\"label\":\"k3\"}" \
  --speculative-config "{$D,\"execution\":\"auto\",\"label\":\"auto\"}" \
  --output $OUT/$ds/spec_bench.json > $OUT/$ds/spec_bench.log 2>&1
python3 -m bench.table $OUT/$ds/spec_bench.json 2>&1 | tail -8
done
