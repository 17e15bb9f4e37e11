# From the repository root, after: gunzip -c bench/results/cpu-2026-12-06-s33/traces.json.gz > /tmp/traces.json
OUT=${OUT:-.}
for cost in 0 0.07 0.12; do for ds in gsm8k:gsm humaneval:he mt_bench:mt; do n=${ds%%:*}; t=${ds##*:}; for seed in 0 1 2 3; do for flag in False True; do
  .venv/bin/python -m bench.policy_replay --traces /tmp/traces.json --step-times bench/results/h100-2026-12-07-s42/table/$t.json --datasets $n --batch-sizes 16,32,64 --seed $seed --switch-costs 1.3,2 --ranking-cost-ms $cost --set HOLD_PLAIN_ACROSS_JOINS=$flag --output $OUT/${n}_${seed}_${flag}_c$cost.json > $OUT/${n}_${seed}_${flag}_c$cost.log 2>&1
done; done; done; done

