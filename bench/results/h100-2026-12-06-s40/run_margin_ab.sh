for m in dflash flexdraft; do cp /tmp/stage/bundle/drafters/$m/model.safetensors flexspec/data/drafters/smollm2-135m-instruct-$m/; done
export FLEXSPEC_CACHE_DIR=/tmp/flexspec-cache PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep "Model name"
D='"method":"dflash","model":"smollm2-135m-instruct-dflash"'
K15="{$D,\"num_speculative_tokens\":15,\"execution\":\"decoupled\",\"label\":\"k15\"}"
AUTO="{$D,\"execution\":\"auto\",\"label\":\"auto\"}"
OLDM='import sys,runpy
import flexspec.spec.policy_tuning as T
T.SPEC_MARGIN_LARGE_BATCH=T.SPEC_MARGIN
sys.argv=["spec_bench"]+sys.argv[1:]; runpy.run_module("bench.spec_bench", run_name="__main__")'
mkdir -p $OUT/r
SB="--num-prompts 32 --requests-per-batch 4 --max-tokens 128 --repeats 2 --gpu-memory-utilization 0.3 --no-progress"
save() { (cd $OUT && tar czf res.tgz r); }
for d in mt_bench humaneval gsm8k; do
  timeout 150 python3 -m bench.spec_bench --dataset $d $SB --batch-sizes 16,32,64 --time-budget-s 120 --speculative-config "$K15" --speculative-config "$AUTO" --output $OUT/r/big_new_$d.json > $OUT/r/big_new_$d.log 2>&1
  timeout 100 python3 -c "$OLDM" --dataset $d $SB --batch-sizes 16,32,64 --time-budget-s 80 --speculative-config "$AUTO" --output $OUT/r/big_old_$d.json > $OUT/r/big_old_$d.log 2>&1
  for v in new old; do echo "== $v $d"; python3 -m bench.table $OUT/r/big_${v}_$d.json 2>&1 | grep -E "^\| $d"; done
  save
done
for d in gsm8k mt_bench humaneval; do
  timeout 110 python3 -m bench.spec_bench --dataset $d $SB --batch-sizes 1,2,4,8 --time-budget-s 90 --speculative-config "$K15" --speculative-config "$AUTO" --output $OUT/r/small_$d.json > $OUT/r/small_$d.log 2>&1
  echo "== small $d"; python3 -m bench.table $OUT/r/small_$d.json 2>&1 | grep -E "^\| $d"
  save
done
ls -la $OUT
