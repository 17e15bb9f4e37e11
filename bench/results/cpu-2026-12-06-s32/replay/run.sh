T=/work/main/bench/results/h200-2026-12-02-s14/traces/trace_dflash.json; S=/work/main/bench/results/h200-2026-12-05-s26/spec/spec_bench.json
cp /work/main/bench/policy_replay.py /tmp/oldpol/bench/policy_replay.py
for c in 1.6,1.3 1,1 1.2,1.2; do for seed in 0 1 2 3; do for tree in /work/main /tmp/oldpol; do
 name=$(basename $tree); [ $name = main ] && name=new || name=old
 (cd $tree && PYTHONPATH=$tree nice -n 10 /work/main/.venv/bin/python -m bench.policy_replay --traces $T --step-times $S --batch-sizes 1,2,4,8,16,32,64 --datasets gsm8k,mt_bench,humaneval --switch-costs $c --seed $seed --output /tmp/rp2/${name}_${c}_s${seed}.json > /dev/null 2>&1)
done; done; done
echo done > /tmp/rp2/DONE
