#!/usr/bin/env bash
# The main job, end to end: serve the default model with speculative decoding on a local Ray cluster, answer a
# real OpenAI-style chat request (streamed), print the answer and a summary line (tokens, time, speculative
# acceptance from /metrics), shut down.
#   bash scripts/demo.sh [CONFIG [flexspec serve options...]]
#   bash scripts/demo.sh configs/serve.yaml --speculative-config '{"method": "ngram"}'
# Environment: PORT (default 8000), PYTHON (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${1:-configs/serve.yaml}
[ $# -gt 0 ] && shift
PORT=${PORT:-8000}
PY=${PYTHON:-.venv/bin/python}
# health probe without curl (a fresh machine may not have it)
healthy() { "$PY" -c "import sys, urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" >/dev/null 2>&1; }
LOG=$(mktemp -t flexspec-serve.XXXXXX.log)
"$PY" -m flexspec.cli serve --config "$CONFIG" --host 127.0.0.1 --port "$PORT" "$@" >"$LOG" 2>&1 &
PID=$!
trap 'kill -TERM $PID 2>/dev/null || true; wait $PID 2>/dev/null || true' EXIT
echo "starting flexspec serve (log: $LOG) ..."
for _ in $(seq 1 180); do
  if healthy; then break; fi
  if ! kill -0 $PID 2>/dev/null; then echo "server exited:"; tail -n 40 "$LOG"; exit 1; fi
  sleep 1
done
healthy || { echo "server not healthy after 180 s"; tail -n 40 "$LOG"; exit 1; }
"$PY" scripts/demo_client.py --url "http://127.0.0.1:$PORT" --max-tokens 96
echo "stopping the server ..."
