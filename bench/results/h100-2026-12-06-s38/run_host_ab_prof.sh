set -x
for m in dflash flexdraft; do cp /tmp/stage/bundle/drafters/$m/model.safetensors flexspec/data/drafters/smollm2-135m-instruct-$m/; done
export FLEXSPEC_CACHE_DIR=/tmp/flexspec-cache PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name --format=csv,noheader
D='{"method":"dflash","model":"smollm2-135m-instruct-dflash","execution":"decoupled"}'
mkdir -p $OUT/host $OUT/ab $OUT/prof
# 1. host profile: spec k15 at b=64, 16, 1 and plain at 64
STEPS=100 python3 scripts/profile_spec_host.py "$D" 64,16,1 $OUT/host > $OUT/host/spec.log 2>&1
STEPS=100 python3 scripts/profile_spec_host.py null 64 $OUT/host > $OUT/host/plain.log 2>&1; mv $OUT/host/host_b64.txt $OUT/host/plain_b64.txt 2>/dev/null
grep "ms/step" $OUT/host/*.log
# 2. A/B: target logits bf16 (new) vs fp32 copy (old), always decoupled k15, GSM8K full batches
PL="--speculative-config {\"method\":\"dflash\",\"model\":\"smollm2-135m-instruct-dflash\",\"execution\":\"auto\"} --dataset gsm8k --num-prompts 256 --max-tokens 128 --force decoupled"
OLD='import sys,runpy; import flexspec.models.llama as L; o=L.LlamaForCausalLM.compute_logits; L.LlamaForCausalLM.compute_logits=lambda s,h,upcast=True: o(s,h,True); sys.argv=["policy_log.py"]+sys.argv[1:]; runpy.run_path("scripts/policy_log.py", run_name="__main__")'
for b in 64 16; do for r in 1 2; do
  python3 scripts/policy_log.py $PL --batch-size $b --out $OUT/ab/new_b${b}_r$r.json > $OUT/ab/new_b${b}_r$r.log 2>&1
  python3 -c "$OLD" $PL --batch-size $b --out $OUT/ab/old_b${b}_r$r.json > $OUT/ab/old_b${b}_r$r.log 2>&1
  tail -2 $OUT/ab/new_b${b}_r$r.log $OUT/ab/old_b${b}_r$r.log
done; done
# 3. kernel profile b=1, 64 (new code)
python3 scripts/profile_spec_step.py "$D" 1,64 $OUT/prof/k15.json > $OUT/prof/k15.log 2>&1; grep batch_size $OUT/prof/k15.log
cd $OUT && tar czf ab.tgz ab && rm -rf ab && tar czf host.tgz host && rm -rf host && ls -la
