#!/bin/bash
# vLLM 0.32.0's own OpenAI-server tests (tests/ of its PyPI sdist) against pagoda: each test's
# server fixture starts `pagoda serve smollm2 --served-model-name <the test's model> <its vLLM
# flags>` (utils.py); the hub tokenizer, config and LoRA the tests load become SmolLM2's
# (conftest.py). The tests import vLLM, so the peers' vLLM must be installed
# (../shared/peers/setup.sh), and pagoda must have served smollm2 once (its tokenizer folder).
#   bash docs/benchmarks/vllm_tests/run.sh [test files, relative to vLLM's tests/ root...]
# WORK (default /tmp/pagoda-vllm-tests) holds the sdist, a venv with pytest, results/ and logs/.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../../.." && pwd)
WORK=${WORK:-/tmp/pagoda-vllm-tests}
VLLM_VENV=${VLLM_VENV:-$HOME/.cache/pagoda-peers/venv-vllm}
mkdir -p "$WORK" && cd "$WORK"
if [ ! -d tests ]; then
  if [ ! -f vllm-0.32.0.tar.gz ]; then
    url=$(curl -s https://pypi.org/simple/vllm/ | grep -o 'https://[^"#]*vllm-0\.32\.0\.tar\.gz' | head -1)
    curl -sL "$url" -o vllm-0.32.0.tar.gz
  fi
  tar -xzf vllm-0.32.0.tar.gz vllm-0.32.0/tests && mv vllm-0.32.0/tests tests && rmdir vllm-0.32.0
fi
cp "$HERE/utils.py" tests/utils.py
cp "$HERE/conftest.py" tests/conftest.py
cp "$HERE/pytest.ini" "$HERE/make_fake_lora.py" .
if [ ! -d venv ]; then
  python3 -m venv venv
  ls -d "$VLLM_VENV"/lib/python3*/site-packages > "$(ls -d venv/lib/python3*/site-packages)/zz_vllm.pth"
  venv/bin/pip install -q pytest pytest-asyncio pytest-timeout
fi
FILES=("$@")
[ ${#FILES[@]} -eq 0 ] && FILES=(
  entrypoints/openai/completion/test_completion.py
  entrypoints/openai/chat_completion/test_chat.py
  entrypoints/openai/chat_completion/test_chat_completion.py
  entrypoints/openai/chat_completion/test_chat_echo.py
  entrypoints/openai/chat_completion/test_chat_logit_bias_validation.py
  entrypoints/serve/instrumentator/test_basic.py
  entrypoints/openai/test_return_token_ids.py
  entrypoints/openai/chat_completion/test_batched_chat_completions.py
  entrypoints/openai/chat_completion/test_logprob_token_ids.py
  entrypoints/openai/chat_completion/test_enable_force_include_usage.py
  entrypoints/openai/chat_completion/test_root_path.py
  entrypoints/openai/chat_completion/test_completion_with_function_calling.py
)
mkdir -p results logs
export PAGODA_DIR="$REPO" PAGODA_TEST_LOGS="$WORK/logs"
for f in "${FILES[@]}"; do
  name=$(basename "${f%%::*}" .py)
  echo "=== $f"
  timeout 1800 venv/bin/python -m pytest -p no:cacheprovider --timeout=240 -rA -q "tests/$f" \
    --junitxml="results/$name.xml" > "results/$name.txt" 2>&1 || true
  tail -1 "results/$name.txt"
done
venv/bin/python "$HERE/summarize.py" results
