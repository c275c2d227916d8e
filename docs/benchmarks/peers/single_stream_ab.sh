#!/usr/bin/env bash
# One stream, pagoda against llama.cpp, both servers up at once and driven in turn, ROUNDS rounds
# (default 4): where a host's memory bandwidth moves from minute to minute, runs taken minutes
# apart (sidebyside.sh) compare the minutes, not the systems. Needs what ../shared/peers/setup.sh
# builds. MODEL: an HF directory for pagoda (default smollm2); GGUF: llama.cpp's file for it.
# Each run: N requests (default 6) of 100-150 prompt tokens (new ones each round: --seed ROUND, so that
# neither prefix cache answers), 64 tokens out, c=1; prints one line a run.
set -u
PEERS=${PEERS:-$HOME/.cache/pagoda-peers}
HERE=$(cd "$(dirname "$0")/../../.." && pwd)
MODEL=${MODEL:-smollm2}
GGUF=${GGUF:-$PEERS/models-llamacpp/SmolLM2-135M-Instruct.F16-from-Q4_1.gguf}
ROUNDS=${ROUNDS:-4}; N=${N:-6}; OUT=${OUT:-/tmp/single_stream_ab}
mkdir -p "$OUT"
LG="$PEERS/venv-tools/bin/python $HERE/../shared/peers/loadgen.py"
[ -f "$HERE/../shared/peers/loadgen.py" ] || LG="$PEERS/venv-tools/bin/python $(cd "$HERE/.." && pwd)/shared/peers/loadgen.py"
unset OPENAI_API_KEY
"$HERE/.venv/bin/pagoda" serve "$MODEL" --host 127.0.0.1 --port 8200 > "$OUT/pagoda.server.log" 2>&1 &
p1=$!
"$PEERS/llama.cpp/build/bin/llama-server" -m "$GGUF" --host 127.0.0.1 --port 8080 -t 2 -tb 2 -c 65536 --parallel 16 \
  --cont-batching --no-ui > "$OUT/llamacpp.server.log" 2>&1 &
p2=$!
trap 'kill $p1 $p2 2>/dev/null; wait 2>/dev/null' EXIT
for url in http://127.0.0.1:8200 http://127.0.0.1:8080; do
  for _ in $(seq 300); do curl -sf "$url/health" >/dev/null && break; sleep 1; done
done
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-) | $(grep -m1 -o 'amx_tile' /proc/cpuinfo || echo no-amx)"
for r in $(seq "$ROUNDS"); do
  for s in pagoda:8200 llamacpp:8080; do
    label=${s%%:*}; f="$OUT/$label-$r.json"
    $LG --base-url "http://127.0.0.1:${s##*:}" -n "$N" -c 1 --prompt-tokens 100-150 --max-tokens 64 \
      --force-full-length --quiet --seed "$r" --label "$label" --json-out "$f" > /dev/null 2>&1
    python3 -c "import json,sys; d=json.load(open(sys.argv[1]))['runs'][0]['summary']; print(f\"round {sys.argv[2]} {sys.argv[3]:9s} out {d['output_tok_s']:6.1f} tok/s  decode {d['single_stream_decode_tok_s_mean']:6.1f}  ttft p50 {d['ttft_s']['p50']*1000:6.0f} ms  itl p50 {d['itl_s']['p50']*1000:6.1f} ms  failed {d['failed']}\")" "$f" "$r" "$label"
  done
done
