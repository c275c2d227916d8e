#!/usr/bin/env bash
# lm-evaluation-harness against pagoda's server (`local-completions`: echo + logprobs + max_tokens 0)
# and against transformers (`hf`) on the same GGUF weights, two local tasks (no hub: make_data.py's
# files, the YAMLs beside this script), then every request's loglikelihood compared (compare.py).
# Usage, from the repository root (a venv with lm-eval made once, outside the project's):
#   python3 -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install torch==2.13.0 "lm-eval[api]==0.4.13" gguf
#   LMEVAL=/tmp/lmeval OUT=/tmp/lm_eval bash docs/benchmarks/lm_eval/run.sh [pagoda serve flags...]
# e.g. `--dtype float32`, or `--max-num-batched-tokens 64` (prompts prefilled in chunks).
set -euo pipefail
LMEVAL=${LMEVAL:-/tmp/lmeval}
OUT=${OUT:-/tmp/lm_eval}
PORT=${PORT:-8013}
TASKS=pagoda_capitals,pagoda_pydoc
BATCH=${BATCH:-1}  # prompts a request carries (lm-eval batches contexts into one request)
HERE=docs/benchmarks/lm_eval
GGUF=$(.venv/bin/python -c "from pagoda.models.loader import resolve_model_path; print(resolve_model_path('smollm2'))")
rm -rf "$OUT" && mkdir -p "$OUT"
.venv/bin/python -c "
import sys; from pathlib import Path; from transformers import AutoTokenizer
p = Path(sys.argv[1]); AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name).save_pretrained(sys.argv[2])" "$GGUF" "$OUT/tokenizer"
.venv/bin/pagoda serve smollm2 --port "$PORT" "$@" > "$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 120); do curl -sf "localhost:$PORT/health" > /dev/null && break; sleep 1; done
"$LMEVAL/bin/lm_eval" --model local-completions --batch_size "$BATCH" --include_path "$HERE" --tasks "$TASKS" --log_samples \
  --model_args "model=smollm2,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer=$OUT/tokenizer,tokenizer_backend=huggingface,num_concurrent=4,max_retries=1" \
  --output_path "$OUT/pagoda" 2>&1 | grep -E '^\|' | tee "$OUT/pagoda.md"
kill $SERVER
if [ ! -d "${HF_OUT:-$OUT/hf}" ]; then
  "$LMEVAL/bin/lm_eval" --model hf --device cpu --batch_size 8 --include_path "$HERE" --tasks "$TASKS" --log_samples \
    --model_args "pretrained=$(dirname "$GGUF"),gguf_file=$(basename "$GGUF"),dtype=float32" \
    --output_path "${HF_OUT:-$OUT/hf}" 2>&1 | grep -E '^\|' | tee "$OUT/hf.md"
fi
.venv/bin/python "$HERE/compare.py" "$OUT/pagoda" "${HF_OUT:-$OUT/hf}"
