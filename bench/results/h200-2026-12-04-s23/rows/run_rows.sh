set -u
export FLEXSPEC_CACHE_DIR=/tmp/flexspec-cache PYTHONPATH=/tmp/site:.
mkdir -p $OUT/rows
for R in 2 4 8 2 8; do
  FLEXSPEC_SKINNY_LINEAR=on timeout 120 python3 _ab/rows_exp.py $R --batch-sizes 1,2,3,4,6,8 --steps 300 --repeats 3 --profile-steps 20 --output $OUT/rows/rows-$R-$RANDOM.json > $OUT/rows/log-$R 2>&1
  echo "R=$R rc=$?"; grep "\[bench" $OUT/rows/log-$R | python3 -c "
import sys,json
for l in sys.stdin:
    d=json.loads(l.split('] ',1)[1]); print(d['batch_size'], d['wall_ms_per_step'], d['kernels_per_step'])"
done
