#!/usr/bin/env bash
# A/B of decoupled DFlash decode steps across revisions on the same machine (session 22)
set -u
export FLEXSPEC_CACHE_DIR=/tmp/flexspec-cache
ROOT=$(pwd)
mkdir -p $OUT/ab
for r in "$@"; do
  if [ "$r" = cur ]; then P=$ROOT; else P=$ROOT/_ab/$r; fi
  for m in dflash flexdraft; do mkdir -p $P/flexspec/data/drafters/smollm2-135m-instruct-$m; cp /tmp/stage/bundle/drafters/$m/model.safetensors $P/flexspec/data/drafters/smollm2-135m-instruct-$m/; done
  (cd $P && PYTHONPATH=/tmp/site:. timeout 200 python3 -m bench.spec_bench --dataset gsm8k --num-prompts 32 --requests-per-batch 4 --batch-sizes 1,8,64 --max-tokens 128 --repeats 1 --gpu-memory-utilization 0.3 --no-progress \
    --speculative-config '{"method":"dflash","model":"smollm2-135m-instruct-dflash","execution":"decoupled","label":"dec"}' --output $OUT/ab/$r.json > $OUT/ab/$r.log 2>&1)
  echo "$r rc=$?"; grep "\[bench" $OUT/ab/$r.log | tail -6
done
