"""Gemma 3's tied 262144 x 640 LM head as int8 records, one input row: alone (`ops.qgemv` on
random records with a scale per 32 weights and with one scale a row, 1 and 2 threads; the bf16
GEMV on the same shape), then in the loaded model (`compute_logits`, `--quantization gguf`).
Best of 10 alone; the model's call averaged over 8 s.
Usage: python docs/benchmarks/quantization/lm_head_records.py
"""
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

from pagoda import LLM  # noqa: E402
from pagoda.layers import cpu_kernels  # noqa: E402
from pagoda.layers.cpu_kernels import ops  # noqa: E402

cpu_kernels.library(); ops.set_num_threads(2); torch.set_num_threads(2)
N, K = 262144, 640


def best(f, n=10):
    f(); b = 1e9
    for _ in range(n):
        s = time.perf_counter(); f(); b = min(b, time.perf_counter() - s)
    return b


for gs in (32, K):
    rec = torch.randint(0, 256, (N, K + 4 * (K // gs)), dtype=torch.uint8)
    rec[:, K:] = 0
    x = torch.randn(1, K).bfloat16()
    for th in (1, 2):
        t = best(lambda: ops.qgemv(x, rec, ops.INT8, K, gs, max_threads=th))
        print(f"int8 records, group {gs}, {th} thread(s): {t*1e3:.2f} ms, {rec.numel()/t/1e9:.1f} GB/s")
w = torch.randn(N, K).bfloat16()
t = best(lambda: ops.gemv(torch.randn(1, K).bfloat16(), w))
print(f"bf16 GEMV: {t*1e3:.2f} ms, {w.numel()*2/t/1e9:.1f} GB/s")
del w, rec
llm = LLM("gemma3-270m", quantization="gguf", enable_prefix_caching=False, max_model_len=1024,
          kv_cache_memory="256MiB")
model = llm.engine.runner.model
h = torch.randn(1, 640).bfloat16()
model.compute_logits(h)
start, n = time.time(), 0
while time.time() - start < 8:
    model.compute_logits(h); n += 1
print(f"in the model: {8e3/n:.2f} ms per LM head call (one row)")
