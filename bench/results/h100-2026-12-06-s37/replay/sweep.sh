cd /work/main
ST=$1; OUTD=$2; shift 2
run() { v=$1; s=$2; args=""; for kv in ${v//+/ }; do [ $kv = base ] || args="$args --set $kv"; done
  .venv/bin/python -m bench.policy_replay --traces /tmp/traces.json --step-times $ST --seed $s $args --output $OUTD/sw_${v}_$s.json > /dev/null 2>&1; }
for v in "$@"; do
  for s in 0 1 2 3 4 5 6 7; do run $v $s & if (( s % 2 == 1 )); then wait; fi; done
done
wait
# usage (traces: gunzip -c bench/results/cpu-2026-12-06-s33/traces.json.gz > /tmp/traces.json):
#   bash sweep.sh bench/results/h100-2026-12-06-s37/spec/gsm8k/spec_bench.json OUTDIR PROBE_NEAR_TIE=2.0 PROBE_NEAR_TIE=0.9
#   bash sweep.sh bench/results/h100-2026-12-06-s36/auto-v4-uncut-gsm8k/spec_bench.json OUTDIR PROBE_NEAR_TIE=2.0 PROBE_NEAR_TIE=0.9
# (each NAME=VALUE+NAME=VALUE list is one variant, 8 seeds; "base" = the code's constants)
