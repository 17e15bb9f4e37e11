#!/usr/bin/env bash
# One time-limited job of the drafter-training pipeline on a GPU machine (the H200 device: < 10 min per command,
# bare Python: torch/triton/transformers/safetensors/numpy + a carried pydantic; no typer/rich/tqdm needed).
#
#   scripts/train_device.sh METHOD RUN_DIR RESULTS_DIR [flags of python -m flexspec.train.run_device ...]
#
# Runs every stage not finished yet in RUN_DIR (generate -> extract -> train -> validate -> package) for at most
# $MAX_MINUTES, checkpointing before the limit, then exports RESULTS_DIR/{summary.json, train_log.jsonl,
# loss_curve.png, bundle.tar.gz.part-NN} (final/ = the packaged drafter, data, latest checkpoint; <= 8 files,
# <= 62 MiB: what the device returns from $OUT). Run the same command again to continue.
#
# Environment:
#   MAX_MINUTES   time limit of the pipeline (default 8.5; loading the target and engines is included)
#   PYTHON        interpreter (default python3)
#   DATA_FROM     a run folder whose data/ (target responses) to reuse when RUN_DIR has none yet
#   IMPORT_FROM   a folder with bundle.tar.gz.part-* to restore when RUN_DIR does not exist (new machine)
#   FLEXSPEC_CACHE_DIR  where a .gguf target is converted once (default /tmp/flexspec-cache)
#
# Exit code: 0 = all stages done, 75 = stopped at the time limit (state saved), other = error.
set -uo pipefail

if [ $# -lt 3 ]; then
    sed -n '2,19p' "$0"
    exit 2
fi
method=$1 run=$2 results=$3
shift 3
py=${PYTHON:-python3}
export FLEXSPEC_CACHE_DIR=${FLEXSPEC_CACHE_DIR:-/tmp/flexspec-cache}
export PYTHONUNBUFFERED=1
repo=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

if [ -n "${IMPORT_FROM:-}" ] && [ ! -f "$run/config.json" ]; then
    "$py" -m flexspec.train.run_device import --from "$IMPORT_FROM" --output "$run" || exit $?
fi
if [ -n "${DATA_FROM:-}" ] && [ ! -d "$run/data" ] && [ -d "$DATA_FROM/data" ]; then
    mkdir -p "$run" && cp -r "$DATA_FROM/data" "$run/data"
fi

"$py" -m flexspec.train.run_device --method "$method" --output "$run" --max-minutes "${MAX_MINUTES:-8.5}" "$@"
rc=$?

mkdir -p "$results"
"$py" -m flexspec.train.run_device export --output "$run" --to "$results" || echo "warning: export failed" >&2
case $rc in
    0) echo "train_device: $method complete; packaged drafter in $run/final (and in the bundle)" ;;
    75) echo "train_device: $method stopped at the time limit; run the same command again to continue" ;;
    *) echo "train_device: $method failed with exit code $rc" >&2 ;;
esac
exit $rc
