cd /work/main
for ap in 0 1; do for ps in 3; do for d in mt_bench:mt humaneval:he; do for seed in 0 1 2 3; do
  IFS=: read -r ds t <<< "$d"
  nice -n 5 .venv/bin/python -m bench.policy_replay --traces /tmp/traces.json --step-times /tmp/rp44/${t}_inflated.json \
    --datasets $ds --seed $seed --switch-costs 1.3,2 --after-exit-cost 1.6 --set PROBE_STEPS=$ps --set ALWAYS_PROBE_PLAIN=$ap \
    --output /tmp/rp44/infl2/${t}_ps${ps}ap${ap}_aec1.6_s${seed}.json > /dev/null 2>&1 || echo FAIL
done; done; done; done
