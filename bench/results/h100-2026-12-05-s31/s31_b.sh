set -u
export FLEXSPEC_CACHE_DIR=/tmp/flexspec-cache
for t in . old_tree; do for m in dflash flexdraft; do cp /tmp/stage/bundle/drafters/$m/model.safetensors $t/flexspec/data/drafters/smollm2-135m-instruct-$m/; done; done
mkdir -p $OUT/spec
D='"method":"dflash","model":"smollm2-135m-instruct-dflash"'
run() {  # $1 tree, $2 tag
  (cd $1 && PYTHONPATH=/tmp/site:. timeout 270 python3 -m bench.spec_bench --dataset gsm8k --num-prompts 32 --requests-per-batch 4 \
    --batch-sizes 16,64 --max-tokens 128 --repeats 2 --gpu-memory-utilization 0.3 --no-progress \
    --speculative-config "{$D,\"execution\":\"decoupled\",\"label\":\"dec\"}" \
    --step-log $OUT/spec/steps_$2 --output $OUT/spec/spec_bench_$2.json > $OUT/spec/spec_bench_$2.log 2>&1
   echo "$2 rc=$?"; grep "\[bench" $OUT/spec/spec_bench_$2.log | cut -c 1-170 | tail -6)
}
run . new
run old_tree d9c661e
cd $OUT/spec && tar czf steps.tgz steps_* && rm -rf steps_*
