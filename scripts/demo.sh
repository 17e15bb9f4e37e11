#!/usr/bin/env bash
# The main job, end to end: serve the default model with speculative decoding on a local Ray cluster,
# answer a real OpenAI-style chat request (streamed), print the metrics it produced, shut down.
#   bash scripts/demo.sh [configs/serve.yaml]
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${1:-configs/serve.yaml}
PORT=${PORT:-8000}
LOG=$(mktemp -t flexspec-serve.XXXXXX.log)
.venv/bin/flexspec serve --config "$CONFIG" --port "$PORT" >"$LOG" 2>&1 &
PID=$!
trap 'kill -TERM $PID 2>/dev/null || true; wait $PID 2>/dev/null || true' EXIT
echo "starting flexspec serve (log: $LOG) ..."
for _ in $(seq 1 180); do
  if curl -sf "localhost:$PORT/health" >/dev/null 2>&1; then break; fi
  if ! kill -0 $PID 2>/dev/null; then echo "server exited:"; tail -n 40 "$LOG"; exit 1; fi
  sleep 1
done
curl -sf "localhost:$PORT/health" >/dev/null || { echo "server not healthy after 180 s"; tail -n 40 "$LOG"; exit 1; }
echo "== POST /v1/chat/completions (stream) =="
curl -sN "localhost:$PORT/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "model": "smollm2-135m-instruct",
  "messages": [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}],
  "max_tokens": 96, "temperature": 0, "stream": true, "stream_options": {"include_usage": true}}'
echo
echo "== speculative decoding counters (/metrics) =="
curl -s "localhost:$PORT/metrics" | grep -E '^vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens)(_total)?\{' || true
