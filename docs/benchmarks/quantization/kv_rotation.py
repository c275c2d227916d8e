"""Does rotating Q and K help an fp8 KV cache everywhere in the text, not only on `bench quality`'s
windows? Perplexity (chunks of 128 through the paged pool) over the first 512 tokens of
pydoc_data.topics and five 1,024-token windows further on (8,192 tokens apart), for a bf16 pool,
an fp8 e4m3 pool with Q and K rotated (pagoda's default) and one without (the rotation switched
off by overriding `PagedAttention.rotates_qk`).
Usage: python docs/benchmarks/quantization/kv_rotation.py
"""
from pagoda.bench.quality import held_out_ids, perplexity
from pagoda.layers.attention import PagedAttention
from pagoda.llm import LLM

WINDOWS = [(0, 512)] + [(8192 * i, 1024) for i in range(1, 6)]
rotates = PagedAttention.rotates_qk
results = {}
for name, engine_args, rotate in [("bf16 pool", {}, True), ("fp8, Q and K rotated", {"kv_cache_dtype": "fp8"}, True),
                                  ("fp8, not rotated", {"kv_cache_dtype": "fp8"}, False)]:
    PagedAttention.rotates_qk = rotates if rotate else (lambda self, pool: False)
    llm = LLM("smollm2", dtype="bfloat16", **engine_args)
    ids = held_out_ids(llm.tokenizer)
    results[name] = [perplexity(llm, ids[start:], 1, window, 128)[0] for start, window in WINDOWS]
    del llm
PagedAttention.rotates_qk = rotates
print("windows (start, tokens): " + "  ".join(f"{s}+{w}" for s, w in WINDOWS))
print(f"{'bf16 pool':22s} " + "  ".join(f"{p:7.3f}" for p in results["bf16 pool"]))
for name in ("fp8, Q and K rotated", "fp8, not rotated"):
    ratios = [p / b - 1 for p, b in zip(results[name], results["bf16 pool"], strict=True)]
    print(f"{name:22s} " + "  ".join(f"{r:+7.2%}" for r in ratios) + f"   mean {sum(ratios) / len(ratios):+.2%}")
