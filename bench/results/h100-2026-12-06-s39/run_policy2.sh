for m in dflash flexdraft; do cp /tmp/stage/bundle/drafters/$m/model.safetensors flexspec/data/drafters/smollm2-135m-instruct-$m/; done
export FLEXSPEC_CACHE_DIR=/tmp/flexspec-cache PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep "Model name"
mkdir -p $OUT/pol2
PL='--speculative-config {"method":"dflash","model":"smollm2-135m-instruct-dflash","execution":"auto"} --max-tokens 128 --dataset mt_bench'
STUB='import sys,runpy; import flexspec.spec.policy as P; C=P.SpeculationPolicy; o=C.decide
def d(self, sched):
    return o(self, sched) if self.forced is not None else self._decision("plain")
C.decide=d; sys.argv=["policy_log.py"]+sys.argv[1:]; runpy.run_path("scripts/policy_log.py", run_name="__main__")'
for b in 1 64; do
  n=$((b*4)); [ $n -lt 32 ] && n=32
  for r in 1 2; do
  for f in auto plain stub; do
    F=""; [ $f = plain ] && F="--force plain"
    if [ $f = stub ]; then timeout 100 python3 -c "$STUB" $PL --num-prompts $n --batch-size $b --out $OUT/pol2/b${b}_${f}_r$r.json > $OUT/pol2/b${b}_${f}_r$r.log 2>&1
    else timeout 100 python3 scripts/policy_log.py $PL --num-prompts $n --batch-size $b $F --out $OUT/pol2/b${b}_${f}_r$r.json > $OUT/pol2/b${b}_${f}_r$r.log 2>&1; fi
    echo "b=$b $f r$r $(tail -1 $OUT/pol2/b${b}_${f}_r$r.log | cut -c1-190)"
  done; done
  for f in auto plain; do
    F=""; [ $f = plain ] && F="--force plain"
    timeout 100 python3 scripts/policy_log.py $PL --num-prompts $n --batch-size $b $F --out $OUT/pol2/prof_b${b}_$f.json --profile $OUT/pol2/prof_b${b}_$f.txt > $OUT/pol2/prof_b${b}_$f.log 2>&1
    echo "prof b=$b $f $(tail -1 $OUT/pol2/prof_b${b}_$f.log | cut -c1-190)"
  done
done
cd $OUT && tar czf pol2.tgz pol2 && rm -rf pol2 && ls -la
