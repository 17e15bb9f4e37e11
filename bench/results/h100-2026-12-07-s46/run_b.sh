#!/usr/bin/env bash
set -uo pipefail
export FLEXSPEC_CACHE_DIR=/tmp/flexspec-cache PYTHONPATH=/tmp/site:.
ls flexspec/data/drafters/smollm2-135m-instruct-dflash/ /tmp/flexspec-cache | head; 
for m in dflash flexdraft; do cp /tmp/stage/bundle/drafters/$m/model.safetensors flexspec/data/drafters/smollm2-135m-instruct-$m/; done
python3 -m flexspec.cli prepare-model smollm2-135m-instruct 2>&1 | tail -1
rm -rf /tmp/t; OUT2=$OUT; OUT=/tmp/t RUNS="he:humaneval:230 mt:mt_bench:230" bash scripts/issue6_table.sh
tar cJf $OUT2/table_hemt.tar.xz -C /tmp t
