"""Weight quantization and the fp8 KV cache in the engine, on the tiny random models.

- config: vLLM's names, and a ValueError naming the value for anything else;
- packing: int4/int8 round to nearest (error at most half a step) (GGUF's blocks and their
  loading: tests/test_quantization_gguf.py);
- the engine: every scheme composes with chunked prefill, prefix caching and preemption (the
  same greedy tokens as the same scheme run plainly, in fp32), with and without the kernels;
- the fp8 pool: one byte a value, so the same memory holds twice the blocks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda import LLM, SamplingParams
from pagoda.config import CacheConfig, EngineConfig, ModelConfig
from pagoda.kv_cache import KVCacheSpec, num_blocks_for, resolve_kv_cache_dtype
from pagoda.layers import cpu_kernels
from pagoda.layers.linear import UNQUANTIZED, Linear
from pagoda.layers.quantization import packing, quantize_model
from pagoda.layers.quantization.methods import PackedLinearMethod
from pagoda.layers.tensor_parallel import VocabParallelEmbedding

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(100, 49000, (40,), generator=g).tolist()
    return [prefix + torch.randint(100, 49000, (n,), generator=g).tolist() for n in (3, 21, 0, 9)]


# ---------------------------------------------------------------- config

@pytest.mark.parametrize("kwargs,name", [
    ({"quantization": "int3"}, "quantization"), ({"quantization_group_size": 48}, "quantization_group_size"),
    ({"kv_cache_dtype": "int8"}, "kv_cache_dtype"), ({"kv_cache_dtype": "fp16"}, "kv_cache_dtype"),
])
def test_config_rejects_unknown_values(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        EngineConfig.from_kwargs("smollm2", **kwargs)


def test_config_takes_vllm_names() -> None:
    config = EngineConfig.from_kwargs("smollm2", quantization="int4", quantization_group_size=128,
                                      kv_cache_dtype="fp8")
    assert config.model == ModelConfig(quantization="int4", quantization_group_size=128)
    assert config.cache.cache_dtype == "fp8"
    assert CacheConfig().cache_dtype == "auto" and ModelConfig().quantization is None


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_pool_holds_twice_the_blocks(cache_dtype: str) -> None:
    dtype = resolve_kv_cache_dtype(cache_dtype, torch.bfloat16)
    assert dtype.itemsize == 1
    bf16, fp8 = KVCacheSpec(30, 3, 64, torch.bfloat16), KVCacheSpec(30, 3, 64, dtype)
    assert bf16.block_bytes(16) == 2 * fp8.block_bytes(16)
    cache = CacheConfig(kv_cache_memory_bytes=1 << 30)
    cpu = torch.device("cpu")
    assert num_blocks_for(fp8, cache, cpu) in (2 * num_blocks_for(bf16, cache, cpu), 2 * num_blocks_for(bf16, cache, cpu) + 1)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_untouched_cpu_pool_tensors_each_have_a_mapping_of_their_own(cache_dtype: torch.dtype) -> None:
    from pagoda.kv_cache import allocate_kv_cache

    spec = KVCacheSpec(2, 3, 64, cache_dtype)
    pools = allocate_kv_cache(spec, 5, 16, torch.device("cpu"), zero=False)
    tensors = [t for pair in pools for t in pair]
    assert all(t.shape == (5, 16, 3, 64) and t.dtype == cache_dtype for t in tensors)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 4
    assert all(t.data_ptr() % 4096 == 0 for t in tensors)  # NOTE: mmap'ed, page-aligned: not heap space
    tensors[1].view(torch.uint8).fill_(7)  # writable, and apart from its neighbours
    assert int(tensors[1].view(torch.uint8).min()) == 7 and int(tensors[0].view(torch.uint8).max()) == 0
    zeroed = allocate_kv_cache(spec, 5, 16, torch.device("cpu"))
    assert all(int(t.view(torch.uint8).abs().max()) == 0 for pair in zeroed for t in pair)


# ---------------------------------------------------------------- packing

@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_round_trip_within_half_a_step(group_size: int) -> None:
    w = torch.randn(24, 256, generator=torch.Generator().manual_seed(group_size))
    packed = packing.quantize_int4(w, group_size)
    assert packed.shape == (24, packing.int4_row_bytes(256, group_size))
    q, d, m = packing.unpack_int4(packed, 256, group_size)
    assert int(q.max()) <= 15
    step = d.float().repeat_interleave(group_size, 1)
    err = (packing.dequantize_int4(packed, 256, group_size, torch.float32) - w).abs()
    assert (err <= step / 2 + 1e-3 * w.abs().amax()).all()
    assert torch.equal(packing.pack_int4(q, d, m), packed)


def test_int8_round_trip_within_half_a_step() -> None:
    w = torch.randn(24, 192, generator=torch.Generator().manual_seed(1))
    packed = packing.quantize_int8(w)
    _, d = packing.unpack_int8(packed, 192)
    err = (packing.dequantize_int8(packed, 192, 192, torch.float32) - w).abs()
    assert d.shape == (24, 1) and (err <= d / 2 * (1 + 1e-6)).all()


# ---------------------------------------------------------------- the engine

def test_quantize_model_packs_every_linear_and_shares_the_tied_embedding(tiny_model_factory) -> None:
    llm = LLM(str(tiny_model_factory("qwen2")), dtype="float32", num_kv_blocks=64)  # tied embeddings
    model = llm.engine.runner.model
    ids = torch.tensor([5, 900, 48000])
    table = model.embed_tokens.weight.detach().clone()
    report = quantize_model(model, "int8")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert report.num_quantized == len(linears) and all(m.method is not UNQUANTIZED for m in linears)
    assert type(model.embed_tokens) is VocabParallelEmbedding and model.embed_tokens.reads_packed_head
    assert torch.allclose(model.embed_tokens(ids), table[ids], atol=table.abs().max().item() / 127)
    assert report.bytes_after < 0.3 * report.bytes_before  # fp32 -> int8, norms aside


COMPOSE = [
    {"quantization": "int8"},
    {"quantization": "int4", "kv_cache_dtype": "fp8"},
    {"quantization": "int4", "quantization_group_size": 64, "kv_cache_dtype": "fp8_e5m2"},
    {"kv_cache_dtype": "fp8_e4m3"},
]


@pytest.mark.parametrize("scheme", COMPOSE, ids=lambda s: "+".join(map(str, s.values())))
@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
def test_schemes_compose_with_chunking_prefix_caching_and_preemption(scheme: dict, kernels: bool, tiny_llama,
                                                                     monkeypatch) -> None:
    if not kernels:
        monkeypatch.setenv("PAGODA_DISABLE_CPU_KERNELS", "1")
        monkeypatch.setattr("pagoda.layers.cpu_kernels._library", None)
        monkeypatch.setattr("pagoda.layers.cpu_kernels._loaded", True)
    plain = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=256, enable_prefix_caching=False, **scheme)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts(), GREEDY, use_tqdm=False)]
    # NOTE: 9 blocks of 16 for four requests of up to 73 tokens: chunks of 16, shared-prefix
    # hits, and preemption by recompute, all in one run.
    busy = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=9, max_model_len=128, max_num_batched_tokens=16,
               **scheme)
    busy.generate(prompts()[:1], GREEDY, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in busy.generate(prompts(), GREEDY, use_tqdm=False)]
    assert got == want
    assert busy.engine.scheduler.num_preemptions > 0 and busy.engine.block_manager.prefix_cache_hits > 0


@pytest.mark.parametrize("cache_dtype,rotated", [("auto", False), ("fp8", True), ("fp8_e5m2", True)])
def test_q_and_k_rotated_over_an_fp8_pool_only(cache_dtype: str, rotated: bool, tiny_llama) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=32, kv_cache_dtype=cache_dtype)
    caches = llm.engine.runner.kv_caches
    assert [a.rotates_qk(kv.k) for a, kv in caches.items()] == [rotated] * len(caches)


def test_fp8_weights_refused_on_cpu_naming_alternatives(tiny_llama) -> None:
    with pytest.raises(ValueError, match="int8.*int4") as info:
        LLM(str(tiny_llama), dtype="float32", quantization="fp8", device="cpu")
    assert "fp8" in str(info.value)


def test_gguf_needs_a_gguf_file(tiny_llama) -> None:
    with pytest.raises(ValueError, match="gguf"):
        LLM(str(tiny_llama), dtype="float32", quantization="gguf")


def test_cache_config_info_labels_show_the_kv_dtype() -> None:
    from prometheus_client import CollectorRegistry

    from pagoda.metrics.prometheus import PrometheusStatLogger

    registry = CollectorRegistry()
    PrometheusStatLogger("m", EngineConfig.from_kwargs("smollm2", kv_cache_dtype="fp8_e5m2"), registry=registry)
    samples = [s for metric in registry.collect() if metric.name == "vllm:cache_config_info" for s in metric.samples]
    assert [s.labels["cache_dtype"] for s in samples] == ["fp8_e5m2"]


def test_kv_report_names_the_cache_dtype() -> None:
    from pagoda.metrics.kv_report import REPORT_KEYS, format_kv_memory_report

    report = dict.fromkeys(REPORT_KEYS, 0) | {"pool_bytes": 1 << 20, "num_blocks": 64, "block_size": 16,
                                              "kv_cache_dtype": "fp8_e4m3"}
    assert "1.0 KiB per slot, fp8_e4m3" in format_kv_memory_report(report)


# NOTE: slow (8 s on a 2-vCPU Zen 3: two workers start) to keep the default suite under its
# 10 minutes there (2026-12-01); tensor parallelism keeps its tiny-model layouts in
# tests/test_parallel.py. `pytest -m slow` runs it.
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: tied, each rank's embedding reads its head shard's records
def test_tensor_parallel_int8_equals_one_process(tiny_model_factory, arch) -> None:
    # NOTE: row-parallel shards take the group's max|w| per channel, so both layouts hold the
    # same codes and scales; the shards' partial sums then add up like the whole row's.
    engine = dict(dtype="float32", max_model_len=256, num_kv_blocks=256, quantization="int8",
                  kv_cache_dtype="fp8")
    model = str(tiny_model_factory(arch))
    want = [o.outputs[0].token_ids for o in LLM(model, **engine).generate(prompts(), GREEDY, use_tqdm=False)]
    llm = LLM(model, tensor_parallel_size=2, **engine)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)] == want
    finally:
        llm.engine.shutdown()


@pytest.mark.skipif(not (cpu_kernels.available() and cpu_kernels.ops.panels_are_native()),
                    reason="needs the GEMM's integer panels (avx512bf16 or avx2 kernels)")
def test_layers_repacked_for_the_gemm_compute_what_their_records_did() -> None:
    from torch import nn

    from pagoda.layers.linear import prepack_for_cpu
    from pagoda.layers.quantization import make_method

    gen = torch.Generator().manual_seed(3)
    model = nn.ModuleList([Linear(96, 70, bias=True), Linear(64, 45), Linear(128, 40, bias=True),
                           Linear(96, 50, bias=True)]).to(torch.bfloat16)
    for layer in model:
        layer.weight.data.copy_(torch.randn(layer.weight.shape, generator=gen) / 8)
        if layer.bias is not None:
            layer.bias.data.copy_(torch.randn(layer.bias.shape, generator=gen))
    model[0].method = make_method("int8", model[0].weight.data, 96)
    # NOTE: group-wise int8 with fp32 scales and codes in [-127, 127] takes panels (avx512bf16's
    # fp32-group kinds, avx2's wide ones); with f16 scales (GGUF's Q8_0), panels with group scales.
    model[1].method = PackedLinearMethod("int8", packing.quantize_int8(model[1].weight.data, 32), 64, 32)
    model[2].method = make_method("int4", model[2].weight.data, 64)
    q8_0 = packing.pack_int8(torch.randint(-127, 128, (50, 96), generator=gen, dtype=torch.int8),
                             (torch.rand(50, 3, generator=gen) / 100).half().float())
    model[3].method = PackedLinearMethod("int8", q8_0, 96, 32)
    dense = [m.method.dequantize(torch.float32) for m in model]
    for layer in model:
        layer.weight.data = torch.empty(0, dtype=torch.bfloat16)
    # NOTE: wide codes with fp32 group scales: avx512bf16's kinds and avx2's wide ones
    assert prepack_for_cpu(model) == 4
    assert model[1].method.panels is not None and model[1].method.packed is None
    rows = torch.tensor([39, 0, 33, 32])
    for layer, w in zip(model, dense, strict=True):
        method = layer.method
        assert method.packed is None and method.panels is not None
        assert torch.equal(method.dequantize(torch.bfloat16, True, rows), w[rows].to(torch.bfloat16))
        assert torch.equal(method.dequantize(torch.float32), w)
        # NOTE: records above NATIVE_MAX_ROWS multiply a bf16-rounded dense weight: looser.
        for m in (1, 17, 70) if method.panels is not None else (1, 16):
            x = torch.randn(m, layer.in_features, generator=gen).to(torch.bfloat16)
            # NOTE: the panels round x to int8 codes by groups (ops.Int4Panels, Int8Panels), and
            # so does the avx2 build's records GEMV (`qgemv_x_group`)
            group = (method.panels.x_group(m) if method.panels is not None
                     else cpu_kernels.ops.qgemv_x_group(layer.in_features, method.group_size))
            xr = packing.round_to_int8_groups(x, group) if group else x.float()
            # NOTE: on AMX tiles int4 panels and grouped int8 ones are widened to a bf16 weight
            panels = method.panels
            widened = panels is not None and panels.amx_at(m) and (
                isinstance(panels, cpu_kernels.ops.Int4Panels) or bool(panels.group_size))
            want = F.linear(xr, w.to(torch.bfloat16).float() if widened else w,
                            layer.bias.float() if layer.bias is not None else None)
            got = layer(x).float()
            excess = (got - want).abs() - (2**-8 * want.abs() + 1e-4 * (xr.abs() @ w.abs().t()))
            assert excess.max().item() <= 0, f"{method.name}, {m} rows: max excess {excess.max().item():.3g}"


def test_processed_weights_stay_as_loading_left_them(tiny_model_factory) -> None:
    """Weight processing runs once, before the first step: generating changes no layer's method
    and replaces no module (a tied embedding reads the packed head as the same module)."""
    llm = LLM(str(tiny_model_factory("qwen2")), dtype="bfloat16", quantization="int8", num_kv_blocks=64)
    model = llm.engine.runner.model
    before = {name: (type(m), id(getattr(m, "method", None))) for name, m in model.named_modules()}
    assert type(model.embed_tokens) is VocabParallelEmbedding and model.embed_tokens.reads_packed_head
    llm.generate([prompts()[0]], GREEDY)
    assert {name: (type(m), id(getattr(m, "method", None))) for name, m in model.named_modules()} == before
