set -x
for m in dflash flexdraft; do cp /tmp/stage/bundle/drafters/$m/model.safetensors flexspec/data/drafters/smollm2-135m-instruct-$m/; done
export FLEXSPEC_CACHE_DIR=/tmp/flexspec-cache PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name --format=csv,noheader
git log --oneline | head -1
mkdir -p $OUT/pol
PL='--speculative-config {"method":"dflash","model":"smollm2-135m-instruct-dflash","execution":"auto"} --max-tokens 128'
for b in 32 64 8 1; do
  n=$((b*4)); [ $n -lt 32 ] && n=32
  for f in auto plain decoupled; do
    F=""; [ $f != auto ] && F="--force $f"
    timeout 100 python3 scripts/policy_log.py $PL --dataset mt_bench --num-prompts $n --batch-size $b $F --out $OUT/pol/mt_b${b}_$f.json > $OUT/pol/mt_b${b}_$f.log 2>&1
    echo "b=$b $f"; tail -1 $OUT/pol/mt_b${b}_$f.log | cut -c1-400
  done
done
cd $OUT && tar czf pol.tgz pol && rm -rf pol && ls -la
