set -x
for m in dflash flexdraft; do cp /tmp/stage/bundle/drafters/$m/model.safetensors flexspec/data/drafters/smollm2-135m-instruct-$m/; done
export FLEXSPEC_CACHE_DIR=/tmp/flexspec-cache PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep "Model name"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .stage/pyt/*.whl > /dev/null 2>&1
mkdir -p $OUT/ab $OUT/t
# old behaviour (session 38): a step in which prompts join waits for the previous step's readback
OLDJ='import sys,runpy
import flexspec.engine.async_scheduling as A
o=A.AsyncSchedulingMixin._launch_ahead
def la(self, st, sched):
    ids={s.seq.seq_id for s,smp in zip(st.sched.scheduled, st.inp.samples) if smp}
    if any(s.seq.seq_id not in ids for s in sched.scheduled):
        return sched, (self.policy.decide(sched) if self.policy is not None and sched.scheduled else None)
    return o(self, st, sched)
A.AsyncSchedulingMixin._launch_ahead=la
sys.argv=["spec_bench"]+sys.argv[1:]; runpy.run_module("bench.spec_bench", run_name="__main__")'
A='{"method":"dflash","model":"smollm2-135m-instruct-dflash","execution":"auto","label":"auto"}'
SB="--num-prompts 32 --requests-per-batch 4 --batch-sizes 16,32,64 --max-tokens 128 --repeats 2 --gpu-memory-utilization 0.3 --no-progress --time-budget-s 90"
for d in mt_bench humaneval; do
  timeout 130 python3 -m bench.spec_bench --dataset $d $SB --speculative-config "$A" --output $OUT/ab/new_$d.json > $OUT/ab/new_$d.log 2>&1
  timeout 100 python3 -c "$OLDJ" --dataset $d $SB --speculative-config "$A" --output $OUT/ab/old_$d.json > $OUT/ab/old_$d.log 2>&1
  for v in new old; do echo "== $v $d"; python3 -m bench.table $OUT/ab/${v}_$d.json 2>&1 | tail -6; done
done
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine tests/spec tests/kernels --continue-on-collection-errors > $OUT/t/gpu_tests.log 2>&1; tail -15 $OUT/t/gpu_tests.log
cd $OUT && tar czf ab.tgz ab t && rm -rf ab t && ls -la
