"""Does a calibrated fp8 KV scale help? Perplexity (as `pagoda bench quality`: 4 windows of
1,024 tokens of pydoc_data.topics, chunks of 256) with an fp8 e4m3 pool at scale 1.0 (pagoda's,
and vLLM's default), then with per-layer scales k_scale = MARGIN * max|K| / 448 (and V alike)
taken from a bf16 pass over other text (the source of Python's `collections`), for each MARGIN.
Usage: python docs/benchmarks/quantization/kv_scales.py [MARGIN ...]   (default 1 4)
"""
import collections
import inspect
import sys

from pagoda.bench.quality import held_out_ids, perplexity
from pagoda.layers.attention import PagedAttention
from pagoda.llm import LLM
from pagoda.models.native_decoder import NativeDecoder

margins = [float(m) for m in sys.argv[1:]] or [1.0, 4.0]
bf16 = LLM("smollm2", dtype="bfloat16")
ids = held_out_ids(bf16.tokenizer)
calibration = list(bf16.tokenizer(inspect.getsource(collections)[:20000], add_special_tokens=False)["input_ids"])[:2048]
amax: dict[int, list[float]] = {}
layer_path = PagedAttention.forward


def recording(self, q, k, v, meta):  # noqa: ANN001, ANN202
    seen = amax.setdefault(id(self), [0.0, 0.0])
    seen[0], seen[1] = max(seen[0], float(k.abs().max())), max(seen[1], float(v.abs().max()))
    return layer_path(self, q, k, v, meta)


reference = perplexity(bf16, ids, 4, 1024, 256)[0]
model = bf16.engine.runner.model
bf16.engine.runner.native_decoder = None  # the layer path, so that every layer's K/V pass the recorder
PagedAttention.forward = recording
perplexity(bf16, calibration, 2, 1024, 256)
PagedAttention.forward = layer_path
scales = [amax[id(a)] for a in model.attention_layers()]
del bf16
print(f"bf16 KV: perplexity {reference:.3f}")
fp8 = LLM("smollm2", dtype="bfloat16", kv_cache_dtype="fp8")
print(f"fp8 e4m3, scale 1: {perplexity(fp8, ids, 4, 1024, 256)[0] / reference - 1:+.2%}")
for margin in margins:
    fp8_model = fp8.engine.runner.model
    for attn, (k_max, v_max) in zip(fp8_model.attention_layers(), scales, strict=True):
        attn.k_scale, attn.v_scale = margin * k_max / 448, margin * v_max / 448
    fp8.engine.runner.native_decoder = NativeDecoder.build(fp8_model, fp8.engine.runner.kv_caches)
    print(f"fp8 e4m3, calibrated scales x{margin:g}: {perplexity(fp8, ids, 4, 1024, 256)[0] / reference - 1:+.2%}")
