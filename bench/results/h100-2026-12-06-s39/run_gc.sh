for m in dflash flexdraft; do cp /tmp/stage/bundle/drafters/$m/model.safetensors flexspec/data/drafters/smollm2-135m-instruct-$m/; done
export FLEXSPEC_CACHE_DIR=/tmp/flexspec-cache
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep "Model name"
D='"method":"dflash","model":"smollm2-135m-instruct-dflash"'
mkdir -p $OUT/gc2
run() {  # name dataset timeout [env]
  env $4 GC_OUT=$OUT/gc2/$1.gc.json PYTHONPATH=bench/results/h100-2026-12-06-s38/gchook:/tmp/site:. timeout $3 python3 -m bench.spec_bench --dataset $2 --num-prompts 32 --requests-per-batch 4 \
   --batch-sizes 1,2,4,8,16,32,64 --max-tokens 128 --repeats 2 --gpu-memory-utilization 0.3 --no-progress --time-budget-s 200 \
   --speculative-config "{$D,\"num_speculative_tokens\":15,\"execution\":\"decoupled\",\"label\":\"k15\"}" \
   --speculative-config "{$D,\"execution\":\"decoupled\",\"num_speculative_tokens\":3,\"label\":\"k3\"}" \
   --speculative-config "{$D,\"execution\":\"auto\",\"label\":\"auto\"}" --output $OUT/gc2/$1.json > $OUT/gc2/$1.log 2>&1
  echo "== $1"; cat $OUT/gc2/$1.gc.json; echo; python3 -m bench.table $OUT/gc2/$1.json 2>&1 | tail -12
}
run mt_freeze mt_bench 120
run mt_nofreeze mt_bench 120 NO_FREEZE=1
run he_freeze humaneval 110
run gsm_freeze gsm8k 170
cd $OUT && tar czf gc2.tgz gc2 && rm -rf gc2 && ls -la
