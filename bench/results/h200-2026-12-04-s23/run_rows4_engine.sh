set -u
export FLEXSPEC_CACHE_DIR=/tmp/flexspec-cache PYTHONPATH=/tmp/site:.
mkdir -p $OUT/rows4 $OUT/engine
timeout 100 python3 -m bench.plain_overhead --batch-sizes 1,2,3,4,8 --steps 300 --repeats 3 --profile-steps 20 --pdl 1,0 --output $OUT/rows4/plain_overhead.json > $OUT/rows4/plain_overhead.log 2>&1
echo "plain_overhead rc=$?"; grep "\[bench" $OUT/rows4/plain_overhead.log | cut -c1-200
MD=$(ls -d /tmp/flexspec-cache/models/smollm2-135m-instruct-*/ | head -1)
timeout 420 python3 -m bench.engine_bench --model-dir $MD --batch-sizes 1,4,8,32,64 --max-tokens 128 --repeats 2 \
  --systems flexspec,hf_dynamic,hf_static_compile --peer-time-budget-s 150 --output $OUT/engine/engine_bench.json > $OUT/engine/engine_bench.log 2>&1
echo "engine rc=$?"; grep -v "it/s\]" $OUT/engine/engine_bench.log | grep "bench\|skinny" | tail -25
