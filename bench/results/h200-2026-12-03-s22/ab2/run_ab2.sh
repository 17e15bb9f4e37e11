#!/usr/bin/env bash
# Session 22 A/B, alternating revisions (host noise drifts): decoupled DFlash at b=16/32/64, GSM8K,
# 7e1b796 (steps that prefill verify on the host) vs the working tree (they verify on the device).
set -u
export FLEXSPEC_CACHE_DIR=/tmp/flexspec-cache
ROOT=$(pwd)
mkdir -p $OUT/ab2
i=0
for r in "$@"; do
  i=$((i+1))
  if [ "$r" = cur ]; then P=$ROOT; else P=$ROOT/_ab/$r; fi
  for m in dflash flexdraft; do mkdir -p $P/flexspec/data/drafters/smollm2-135m-instruct-$m; cp /tmp/stage/bundle/drafters/$m/model.safetensors $P/flexspec/data/drafters/smollm2-135m-instruct-$m/; done
  (cd $P && PYTHONPATH=/tmp/site:. timeout 150 python3 -m bench.spec_bench --dataset gsm8k --num-prompts 32 --requests-per-batch 4 --batch-sizes 16,32,64 --max-tokens 128 --repeats 2 --gpu-memory-utilization 0.3 --no-progress \
    --speculative-config '{"method":"dflash","model":"smollm2-135m-instruct-dflash","execution":"decoupled","label":"dec"}' --output $OUT/ab2/$i-$r.json > $OUT/ab2/$i-$r.log 2>&1)
  echo "$i $r rc=$?"; grep "\[bench" $OUT/ab2/$i-$r.log | tail -6
done
