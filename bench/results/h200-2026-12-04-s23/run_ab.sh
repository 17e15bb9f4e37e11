#!/usr/bin/env bash
# Session 23, H200: decoupled DFlash at b=16/32/64 (GSM8K) across revisions, in alternation (host noise
# drifts): 1ce17c0 (session 21's end) vs this tree with PDL off (the host-side cuts of sessions 22-23 only)
# vs this tree as shipped (PDL on). Args: labels among cur, cur-nopdl, 1ce17c0 (checked out under _ab/).
set -u
export FLEXSPEC_CACHE_DIR=/tmp/flexspec-cache
ROOT=$(pwd)
mkdir -p $OUT/ab
i=0
for r in "$@"; do
  i=$((i+1))
  case $r in cur) P=$ROOT; E=1;; cur-nopdl) P=$ROOT; E=0;; *) P=$ROOT/_ab/$r; E=1;; esac
  for m in dflash flexdraft; do mkdir -p $P/flexspec/data/drafters/smollm2-135m-instruct-$m; cp /tmp/stage/bundle/drafters/$m/model.safetensors $P/flexspec/data/drafters/smollm2-135m-instruct-$m/; done
  (cd $P && FLEXSPEC_PDL=$E PYTHONPATH=/tmp/site:. timeout 150 python3 -m bench.spec_bench --dataset gsm8k --num-prompts 32 --requests-per-batch 4 --batch-sizes 1,16,32,64 --max-tokens 128 --repeats 2 --gpu-memory-utilization 0.3 --no-progress \
    --speculative-config '{"method":"dflash","model":"smollm2-135m-instruct-dflash","execution":"decoupled","label":"dec"}' --output $OUT/ab/$i-$r.json > $OUT/ab/$i-$r.log 2>&1)
  echo "$i $r rc=$?"; grep "\[bench" $OUT/ab/$i-$r.log | tail -8
done
