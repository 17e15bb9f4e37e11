#!/usr/bin/env bash
# PROBE_STEPS 2 vs 3, after-exit cost 1.0 / 1.6, 3 datasets x 4 seeds (session 33's traces, session 42's H100 times)
cd /work/main
for aec in 1.0 1.6; do for ps in 2 3; do for d in gsm8k:gsm mt_bench:mt humaneval:he; do for seed in 0 1 2 3; do
  IFS=: read -r ds t <<< "$d"
  nice -n 5 .venv/bin/python -m bench.policy_replay --traces /tmp/traces.json \
    --step-times bench/results/h100-2026-12-07-s42/table/$t.json --datasets $ds --seed $seed --switch-costs 1.3,2 \
    --after-exit-cost $aec --set PROBE_STEPS=$ps --output /tmp/rp44/${t}_ps${ps}_aec${aec}_s${seed}.json > /dev/null 2>&1 || echo FAIL $d $seed
done; done; done; done
