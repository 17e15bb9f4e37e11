for m in dflash flexdraft; do cp /tmp/stage/bundle/drafters/$m/model.safetensors flexspec/data/drafters/smollm2-135m-instruct-$m/; done
export FLEXSPEC_CACHE_DIR=/tmp/flexspec-cache PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep "Model name"
mkdir -p $OUT/pol
PL='--speculative-config {"method":"dflash","model":"smollm2-135m-instruct-dflash","execution":"auto"} --max-tokens 128'
run() { # dataset b n
  timeout 120 python3 scripts/policy_log.py $PL --dataset $1 --num-prompts $3 --batch-size $2 --out $OUT/pol/$1_b$2.json > $OUT/pol/$1_b$2.log 2>&1
  echo "$1 b=$2 $(tail -1 $OUT/pol/$1_b$2.log | cut -c1-300)"
}
run humaneval 16 128
run mt_bench 64 256
run humaneval 64 256
run mt_bench 16 128
run gsm8k 64 256
run gsm8k 16 128
cd $OUT && tar czf pol.tgz pol && rm -rf pol && ls -la
