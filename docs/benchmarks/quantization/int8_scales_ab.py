"""Gemma 3 270M's tied Q8_0 LM head (262144 x 640) as int8 records with f16 group scales (as
`--quantization gguf` packs it) against the same codes with fp32 scales: bytes, and the GEMM's
time at 1 and 16 rows, alternating the two in one process (medians of 15 each).
Usage: python docs/benchmarks/quantization/int8_scales_ab.py
"""
import time, statistics, torch
from pagoda import LLM
from pagoda.layers.cpu_kernels import ops
from pagoda.layers.quantization import packing
llm = LLM("gemma3-270m", quantization="gguf", enable_prefix_caching=False, max_model_len=1024, kv_cache_memory="256MiB")
model = llm.engine.runner.model
for name, m in model.named_modules():
    meth = getattr(m, "method", None)
    if getattr(meth, "packed", None) is not None and name in ("lm_head", "layers.0.self_attn.qkv_proj", "layers.0.mlp.gate_up_proj", "layers.0.mlp.down_proj", "layers.0.self_attn.o_proj"):
        print(name, tuple(meth.packed.shape), "in", meth.in_features, "gs", meth.group_size)
meth = model.lm_head.method
K, gs = meth.in_features, meth.group_size
q, d = packing.unpack_int8(meth.packed, K, gs)
p16 = meth.packed
p32 = torch.cat([q.view(torch.uint8), d.float().contiguous().view(torch.uint8)], 1).contiguous()
print("bytes f16", p16.numel() / 1e6, "MB, fp32", p32.numel() / 1e6, "MB")
for rows in (1, 16):
    x = torch.randn(rows, K).to(torch.bfloat16)
    r16, r32 = ops.Records(p16, ops.INT8, K, gs), ops.Records(p32, ops.INT8, K, gs)
    assert torch.equal(ops.gemm(x, r16), ops.gemm(x, r32))
    t = {16: [], 32: []}
    for _ in range(15):
        for k, r in ((16, r16), (32, r32)):
            s = time.perf_counter(); ops.gemm(x, r); t[k].append(time.perf_counter() - s)
    print(f"rows={rows}: LM head f16 scales {statistics.median(t[16])*1e3:.2f} ms, fp32 scales {statistics.median(t[32])*1e3:.2f} ms")
