for m in dflash flexdraft; do cp /tmp/stage/bundle/drafters/$m/model.safetensors flexspec/data/drafters/smollm2-135m-instruct-$m/; done
export FLEXSPEC_CACHE_DIR=/tmp/flexspec-cache
D='"method":"dflash","model":"smollm2-135m-instruct-dflash"'
mkdir -p $OUT/gc
for ds in mt_bench; do for v in nofreeze freeze; do
  if [ $v = nofreeze ]; then export NO_FREEZE=1; else unset NO_FREEZE; fi
  GC_OUT=$OUT/gc/${ds}_$v.gc.json PYTHONPATH=.stage/gchook:/tmp/site:. timeout 110 python3 -m bench.spec_bench --dataset $ds --num-prompts 32 --requests-per-batch 4 --batch-sizes 16,32,64 \
  --max-tokens 128 --repeats 2 --gpu-memory-utilization 0.3 --no-progress \
  --speculative-config "{$D,\"label\":\"auto\"}" --output $OUT/gc/${ds}_$v.json > $OUT/gc/${ds}_$v.log 2>&1
  echo "$ds $v"; cat $OUT/gc/${ds}_$v.gc.json; echo; python3 -m bench.table $OUT/gc/${ds}_$v.json 2>&1 | tail -3
done; done
cd $OUT && tar czf gc.tgz gc && rm -rf gc
