#!/usr/bin/env bash
# One pagoda server from a checkout (default: this one) serving SmolLM2, then the side-by-side's
# c=16 loadgen run (64 requests, prompts 100-150, 128 tokens forced) at temperature 0.8 with
# top_p 0.9 twice (the first after start-up) and at temperature 1 once; prints output tok/s,
# TTFT p50 and ITL p50. Run it for two checkouts in turn to compare commits (a worktree of the
# parent needs its own .venv link and kernels built).
#   bash docs/benchmarks/sampling/served_ab.sh [CHECKOUT] [OUT]
set -u
REPO=$(cd "$(dirname "$0")/../../.." && pwd)
TREE=${1:-$REPO}; OUT=${2:-/tmp/served_ab}; mkdir -p "$OUT"
PEERS=${PEERS:-$HOME/.cache/pagoda-peers}
SHARED=${SHARED:-$REPO/../shared/peers}
LG="$PEERS/venv-tools/bin/python $SHARED/loadgen.py"
PORT=${PORT:-8201}
up() { for _ in $(seq 400); do curl -sf "$1/health" >/dev/null && return 0; sleep 1; done; return 1; }
unset OPENAI_API_KEY
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && { echo "port $PORT is taken"; exit 1; }
(cd "$TREE" && PYTHONPATH="$TREE" exec .venv/bin/python -m pagoda.cli serve smollm2 --host 127.0.0.1 \
  --port "$PORT" > "$OUT/server.log" 2>&1) &
pid=$!
up "http://127.0.0.1:$PORT" || { echo "the server did not start: $OUT/server.log"; kill $pid; exit 1; }
for run in "0.8 0.9" "0.8 0.9" "1.0 1.0"; do
  set -- $run
  $LG --base-url "http://127.0.0.1:$PORT" -n 64 -c 16 --prompt-tokens 100-150 --max-tokens 128 \
    --force-full-length --quiet --temperature "$1" --extra-body "{\"top_p\": $2}" --label ab > "$OUT/run.txt" 2>&1
  python3 -c "
import json, sys
d = next(json.loads(l) for l in open('$OUT/run.txt') if l.startswith('{\"label'))
print('$TREE', 'T=$1 top_p=$2', round(d['output_tok_s'], 1), 'tok/s  ttft p50', round(d['ttft_s']['p50'] * 1000),
      'ms  itl p50', round(d['itl_gap_s']['p50'] * 1000, 1), 'ms  failed', d['failed'])"
done
kill $pid 2>/dev/null; wait $pid 2>/dev/null
