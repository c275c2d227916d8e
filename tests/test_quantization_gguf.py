"""GGUF-packed weights: block decoders, record formats, loaders, and a whole GGUF loaded packed.

- every decoded kind (models/gguf_blocks.py) equals the `gguf` package's dequantization bit
  for bit, over random blocks (random bytes; f16 fields random finite values of any exponent);
- each kind's record formats (layers/quantization/gguf.py) hold its weights exactly, but Q4_K
  in int4 records: |w' - w| <= 2^-11 (|q d sc| + |dmin m|) + 2^-21 (f16 subnormals: 2^-25 for
  each of 16 steps and the offset) + 2^-23 |w| (fp32 rounding of both sides);
- fused layers whose sources differ take the int8 form; codes, scales and offsets load through
  the fused and tensor-parallel loaders into the right rows;
- a tiny Llama written as a GGUF of every kind loads packed: every linear packed in the format
  expected, each packed weight the float load's (Q4_K within its bound), and the prompt's
  logprobs within 0.05 of the float model's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from pagoda.distributed.group import ParallelGroup
from pagoda.layers import cpu_kernels
from pagoda.layers.linear import Linear
from pagoda.layers.quantization import gguf as gguf_quant
from pagoda.layers.quantization.gguf import (
    PREFERRED,
    RecordFormat,
    int8_form,
    packed_method,
    to_format,
)
from pagoda.layers.quantization.methods import PackedLinearMethod
from pagoda.layers.tensor_parallel import MergedColumnParallelLinear, RowParallelLinear
from pagoda.models.gguf import dequantize_blocks
from pagoda.models.gguf_blocks import BLOCK_BYTES, DECODED_KINDS, decode

# byte offsets of each kind's f16 fields in its block (d; dmin or m)
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
              "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator,
                  scale: float | None = None) -> np.ndarray:
    """Raw blocks [rows, bytes a row] of random bytes whose f16 fields are finite: random bit
    patterns (any exponent, subnormals included), or values of about `scale`."""
    size, per_block = BLOCK_BYTES[kind]
    blocks = rng.integers(0, 256, (rows * cols // per_block, size), dtype=np.uint8)
    for at in F16_FIELDS[kind]:
        if scale is None:
            bits = rng.integers(0, 1 << 16, len(blocks), dtype=np.uint16)
            bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF  # NOTE: no inf or NaN: exponent < 31
        else:
            bits = (scale * rng.uniform(0.25, 1, len(blocks))).astype(np.float16).view(np.uint16)
        blocks[:, at:at + 2] = bits.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def gguf_dequantized(raw: np.ndarray, kind: str, rows: int) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return np.asarray(dequantize(raw, GGMLQuantizationType[kind]), dtype=np.float32).reshape(rows, -1)


@pytest.mark.parametrize("kind", DECODED_KINDS)
def test_blocks_decode_to_what_gguf_dequantizes(kind: str) -> None:
    rng = np.random.default_rng(len(kind) + BLOCK_BYTES[kind][0])
    per_block = BLOCK_BYTES[kind][1]
    for rows, blocks in ((1, 1), (3, 2), (5, 3)):
        raw = random_blocks(kind, rows, blocks * per_block, rng)
        decoded = decode(raw, kind, rows)
        low, high = decoded.code_range
        assert decoded.codes.dtype == torch.int8 and low <= int(decoded.codes.min()) and int(decoded.codes.max()) <= high
        want = gguf_dequantized(raw, kind, rows)
        assert np.array_equal(decoded.dequantize().numpy().view(np.uint32), want.view(np.uint32))
        assert np.array_equal(dequantize_blocks(raw, kind, rows).view(np.uint32), want.view(np.uint32))


def _formats(kind: str) -> list[RecordFormat]:
    """The kind's preferred records and every int8 form that holds it."""
    groups = (16,) if kind == "Q6_K" else (16, 32)
    return [PREFERRED[kind], *(RecordFormat("int8", g, int8_form({kind}).offsets) for g in groups)]


def q4_k_bound(raw: np.ndarray, rows: int) -> torch.Tensor:
    """Q4_K in int4 records: the f16 rounding of d * sc and dmin * m (module docstring)."""
    blocks = decode(raw, "Q4_K", rows)
    assert blocks.offset is not None
    step = 2**-11 * (blocks.codes.float().view(rows, -1, 32) * blocks.scale[..., None]).abs()
    step += 2**-11 * blocks.offset.abs()[..., None] + 2**-21
    want = blocks.dequantize().view(rows, -1, 32)
    return (step + 2**-23 * want.abs()).view(rows, -1)


@pytest.mark.parametrize("kind", DECODED_KINDS)
def test_record_formats_hold_each_kind(kind: str) -> None:
    rng = np.random.default_rng(7)
    rows, cols = 6, 512
    # NOTE: scales of about 2^-8 (some subnormal in f16 once multiplied by small 6-bit sc):
    # weights of a real file's size, where the f16 records cannot overflow.
    raw = random_blocks(kind, rows, cols, rng, scale=2**-8)
    want = torch.from_numpy(gguf_dequantized(raw, kind, rows))
    for fmt in _formats(kind):
        method = packed_method(fmt, *to_format(decode(raw, kind, rows), fmt))
        got = method.dequantize(torch.float32)
        if kind == "Q4_K" and fmt.scheme == "int4":
            assert ((got - want).abs() <= q4_k_bound(raw, rows)).all()
            assert not torch.equal(got, want)  # NOTE: the bound is needed: f16 does round here
        else:
            assert torch.equal(got, want), fmt
        rows_wanted = torch.tensor([4, 0, 4])
        assert torch.equal(method.dequantize(torch.bfloat16, rows=rows_wanted), got[rows_wanted].bfloat16())


@pytest.mark.parametrize("kinds,fmt", [
    ({"Q4_K"}, RecordFormat("int4", 32)), ({"Q4_0", "Q4_K"}, RecordFormat("int4", 32)),
    ({"Q5_0", "Q8_0"}, RecordFormat("int8", 32)), ({"Q5_0", "Q6_K"}, RecordFormat("int8", 16)),
    ({"Q4_K", "Q6_K"}, RecordFormat("int8", 16, True)), ({"Q5_K"}, RecordFormat("int8", 32, True)),
    ({"Q4_1", "Q8_0"}, RecordFormat("int8", 32, True)), ({"Q4_K", None}, None), ({"F16"}, None),
])
def test_fused_sources_share_one_format(kinds: set[str | None], fmt: RecordFormat | None) -> None:
    assert gguf_quant.format_for(Linear(512, 64), kinds) == fmt


def test_int4_kinds_take_the_int8_form_where_int4_does_not_fit() -> None:
    assert gguf_quant.format_for(Linear(96, 8), {"Q4_0"}) == RecordFormat("int8", 32)
    assert gguf_quant.format_for(Linear(96, 8), {"Q4_1"}) == RecordFormat("int8", 32, True)
    assert gguf_quant.format_for(Linear(80, 8), {"Q4_0"}) is None


def _load_packed(layer: Linear, shards: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    """Loads full (unsharded) codes/scales/offsets through the layer's prepared loaders."""
    params = dict(layer.named_parameters())
    for i, (codes, d, m) in enumerate(shards):
        extra = (i,) if isinstance(layer, MergedColumnParallelLinear) else ()
        for name, t in (("weight", codes), ("weight_scale", d), ("weight_zero", m)):
            params[name].weight_loader(params[name], t, *extra)  # type: ignore[attr-defined]


def _random_parts(fmt: RecordFormat, rows: int, cols: int, g: torch.Generator
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    low, high = (0, 15) if fmt.scheme == "int4" else (-32, 31)
    groups = cols // fmt.group_size
    return (torch.randint(low, high + 1, (rows, cols), generator=g).float(),
            torch.rand(rows, groups, generator=g) / 10, torch.randn(rows, groups, generator=g) / 10)


def _dense(fmt: RecordFormat, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    if fmt.scheme == "int4":
        d, m = d.half().float(), m.half().float()
    return codes * d.repeat_interleave(fmt.group_size, 1) + m.repeat_interleave(fmt.group_size, 1)


@pytest.mark.parametrize("fmt", [RecordFormat("int4", 32), RecordFormat("int8", 16, True)], ids=str)
@pytest.mark.parametrize("rank", [0, 1])
def test_gguf_packed_shards_load_through_parallel_loaders(fmt: RecordFormat, rank: int) -> None:
    g = torch.Generator().manual_seed(rank)
    tp = ParallelGroup(rank=rank, size=2)
    merged = MergedColumnParallelLinear(128, [64, 128], tp=tp)
    row = RowParallelLinear(256, 32, tp=tp)
    for layer in (merged, row):
        gguf_quant.prepare_linear(layer, fmt)
    full = [_random_parts(fmt, 64, 128, g), _random_parts(fmt, 128, 128, g)]
    _load_packed(merged, full)
    row_full = _random_parts(fmt, 32, 256, g)
    _load_packed(row, [row_full])
    gguf_quant.finish_gguf_load(merged)
    gguf_quant.finish_gguf_load(row)
    want_merged = torch.cat([_dense(fmt, *full[0])[rank * 32:(rank + 1) * 32],
                             _dense(fmt, *full[1])[rank * 64:(rank + 1) * 64]])
    want_row = _dense(fmt, *row_full)[:, rank * 128:(rank + 1) * 128]
    for layer, want in ((merged, want_merged), (row, want_row)):
        assert isinstance(layer.method, PackedLinearMethod) and layer.method.name.startswith(fmt.scheme)
        assert torch.equal(layer.method.dequantize(torch.float32), want)


# ---------------------------------------------------------------- a whole GGUF, packed

# Per layer: (q, k, v, o, gate, up, down) kinds; every kind, the int4 and int8 records with
# and without offsets, groups of 16 and 32, and mixed fused sources.
LAYER_KINDS = [("Q4_K", "Q4_K", "Q6_K", "Q5_K", "Q5_0", "Q5_1", "Q4_K"),
               ("Q5_0", "Q5_0", "Q8_0", "Q4_K", "Q4_0", "Q4_1", "Q6_K")]
# NOTE: scales for weights of about 0.1 (k-quants: d * 63-ish sc times q)
KIND_SCALES = {"Q4_0": 2**-6, "Q4_1": 2**-6, "Q5_0": 2**-7, "Q5_1": 2**-7, "Q8_0": 2**-10,
               "Q4_K": 2**-12, "Q5_K": 2**-13, "Q6_K": 2**-14}
HIDDEN, INTERMEDIATE, VOCAB = 256, 512, 512
EXPECTED = {  # module: (its sources' kinds, its method)
    "layers.0.self_attn.qkv_proj": ("Q4_K Q4_K Q6_K", "int8 (group 16, offsets)"),
    "layers.0.self_attn.o_proj": ("Q5_K", "int8 (group 32, offsets)"),
    "layers.0.mlp.gate_up_proj": ("Q5_0 Q5_1", "int8 (group 32, offsets)"),
    "layers.0.mlp.down_proj": ("Q4_K", "int4 (group 32)"),
    "layers.1.self_attn.qkv_proj": ("Q5_0 Q5_0 Q8_0", "int8 (group 32)"),
    "layers.1.self_attn.o_proj": ("Q4_K", "int4 (group 32)"),
    "layers.1.mlp.gate_up_proj": ("Q4_0 Q4_1", "int4 (group 32)"),
    "layers.1.mlp.down_proj": ("Q6_K", "int8 (group 16)"),
    "lm_head": ("Q6_K", "int8 (group 16)"),
}


def write_tiny_gguf(path: Path, layer_kinds: list[tuple[str, ...]] = LAYER_KINDS) -> None:
    from gguf import GGMLQuantizationType, GGUFWriter

    rng = np.random.default_rng(3)
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.attention.head_count", 4)
    writer.add_uint32("llama.attention.head_count_kv", 2)

    def add(name: str, kind: str, rows: int, cols: int) -> None:
        if kind == "F32":
            writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(cols)).astype(np.float32))
            return
        raw = random_blocks(kind, rows, cols, rng, KIND_SCALES[kind])
        writer.add_tensor(name, raw, raw_dtype=GGMLQuantizationType[kind])

    writer.add_tensor("token_embd.weight", (0.3 * rng.standard_normal((VOCAB, HIDDEN))).astype(np.float32))
    add("output_norm.weight", "F32", 1, HIDDEN)
    add("output.weight", "Q6_K", VOCAB, HIDDEN)
    shapes = [("attn_q", 256, HIDDEN), ("attn_k", 128, HIDDEN), ("attn_v", 128, HIDDEN), ("attn_output", HIDDEN, 256),
              ("ffn_gate", INTERMEDIATE, HIDDEN), ("ffn_up", INTERMEDIATE, HIDDEN), ("ffn_down", HIDDEN, INTERMEDIATE)]
    for i, kinds in enumerate(layer_kinds):
        add(f"blk.{i}.attn_norm.weight", "F32", 1, HIDDEN)
        add(f"blk.{i}.ffn_norm.weight", "F32", 1, HIDDEN)
        for (name, rows, cols), kind in zip(shapes, kinds, strict=True):
            add(f"blk.{i}.{name}.weight", kind, rows, cols)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_config_and_tokenizer(out: Path) -> None:
    """The GGUF's config and a word-level tokenizer of VOCAB tokens, as the loader's GGUF
    metadata directory would hold them (made in milliseconds, not converted from a file)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
                rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2).save_pretrained(out)
    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = Whitespace()  # type: ignore[assignment]
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w1", eos_token="w2").save_pretrained(out)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == VOCAB


def test_a_gguf_of_every_kind_loads_packed_as_the_float_load(tmp_path: Path, monkeypatch, caplog) -> None:
    from pagoda import LLM, SamplingParams
    from pagoda.models import loader

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    write_config_and_tokenizer(tmp_path / "hf")
    monkeypatch.setattr(loader, "gguf_metadata_dir", lambda p: tmp_path / "hf")
    # NOTE: the torch path in fp32: x multiplied as it is (the AVX2 kernels round it to int8
    # codes), so only Q4_K's f16 scales and summation order tell the two models apart.
    monkeypatch.setenv("PAGODA_DISABLE_CPU_KERNELS", "1")
    monkeypatch.setattr("pagoda.layers.cpu_kernels._library", None)
    monkeypatch.setattr("pagoda.layers.cpu_kernels._loaded", True)
    engine = dict(dtype="float32", num_kv_blocks=32, max_model_len=128)
    with caplog.at_level("INFO", logger="pagoda"):
        plain = LLM(str(path), **engine)
    # NOTE: loaded dequantized, the start says so and how to keep the blocks packed (vLLM would)
    assert "tiny.gguf holds Q4_0/Q4_1/Q4_K/Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 blocks, loaded dequantized to float32; " \
           "--quantization gguf keeps them packed" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="pagoda"):
        packed = LLM(str(path), quantization="gguf", **engine)
    assert "loaded dequantized" not in caplog.text
    floats = dict(plain.engine.runner.model.named_modules())
    linears = {n: m for n, m in packed.engine.runner.model.named_modules() if isinstance(m, Linear)}
    assert set(linears) == set(EXPECTED)
    for name, (kinds, fmt) in EXPECTED.items():
        method = linears[name].method
        assert isinstance(method, PackedLinearMethod) and method.name == fmt, name
        if method.scheme == "int8":  # NOTE: f16 scales where every source's are f16 (Q8_0, Q5_0/1)
            assert method.packed is not None
            scale_bytes = 2 if set(kinds.split()) <= {"Q8_0", "Q5_0", "Q5_1"} else 4
            assert method.packed.shape[1] == method.in_features * (1 + scale_bytes / method.group_size), name
        got, want = method.dequantize(torch.float32), floats[name].weight
        if "Q4_K" in kinds and method.scheme == "int4":
            # NOTE: Q4_K's f16 scales and offsets: within 2^-10 of the layer's largest weight
            assert (got - want).abs().max() <= 2**-10 * want.abs().max(), name
        else:
            assert torch.equal(got, want), name
    # NOTE: each prompt token's logprob, every layer's product in both models: Q4_K's f16
    # scales and int4's bf16-rounded x move them by at most 0.002 here; a wrong nibble, scale or
    # offset by far more (the weights' checks above find those first).
    prompt = torch.randint(3, VOCAB, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    want, got = (llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs for llm in (plain, packed))
    assert want is not None and got is not None
    diffs = [abs(got[i][t].logprob - want[i][t].logprob) for i, t in enumerate(prompt) if i]  # type: ignore[index]
    assert max(diffs) <= 0.05, diffs


@pytest.mark.skipif(not (cpu_kernels.available() and cpu_kernels.ops.panels_are_native()),
                    reason="needs the GEMM's integer panels (avx512bf16 or avx2 kernels)")
def test_a_gguf_of_every_kind_runs_the_native_stack(tmp_path: Path, monkeypatch) -> None:
    """With the kernels (bf16 activations), the same GGUF runs every layer on the GEMM's panels
    and the one-call decoder stack where the build takes fp32 group scales (avx2 and avx512bf16:
    Q6_K, Q5_K, Q5_1 and the mixed qkv with offsets inside the panels); elsewhere those layers
    keep their records, and a layer with offsets outside keeps the model off the stack. Its
    prompt logprobs and tokens equal, within 0.05 (0.016 at most here), the same model's layer
    path with every linear replaced by exact fp32 products of the dequantized weight and x
    rounded as that layer's kernel rounds it (int8 codes by its groups, or x as it is); and stay
    within 0.3 of the fp32 dequantized model's (bf16 activations and x's int8 rounding move this
    tiny random model's most sensitive token by up to 0.24)."""
    import torch.nn.functional as F

    from pagoda import LLM, SamplingParams
    from pagoda.layers.quantization import packing
    from pagoda.models import loader

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    write_config_and_tokenizer(tmp_path / "hf")
    monkeypatch.setattr(loader, "gguf_metadata_dir", lambda p: tmp_path / "hf")
    prompt = torch.randint(3, VOCAB, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=0, ignore_eos=True)

    def run(llm: LLM) -> tuple[torch.Tensor, list[int]]:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert out.prompt_logprobs is not None
        logprobs = [out.prompt_logprobs[i][t].logprob for i, t in enumerate(prompt) if i]  # type: ignore[index]
        return torch.tensor(logprobs), list(out.outputs[0].token_ids)

    packed = LLM(str(path), quantization="gguf", dtype="bfloat16", num_kv_blocks=32, max_model_len=128)
    f32_groups = cpu_kernels.ops.int8_f32_group_tiles()
    methods = {n: m.method for n, m in packed.engine.runner.model.named_modules() if isinstance(m, Linear)}
    on_panels = {n for n, m in methods.items() if isinstance(m, PackedLinearMethod) and m.panels is not None}
    # NOTE: the random Q8_0 blocks hold codes of -128, which no panel takes (llama-quantize's
    # never do: d = max |w| / 127): layer 1's q/k/v keep their records, which the stack takes.
    records = {"layers.1.self_attn.qkv_proj"}
    assert on_panels == (set(EXPECTED) - records if f32_groups
                         else {n for n, (_, fmt) in EXPECTED.items() if "int4" in fmt})
    # NOTE: Q5_K's 5-bit codes as int5 panels (fp32 d and m) where the build has them
    int5 = {"layers.0.self_attn.o_proj": "int5 (group 32, offsets)"} if cpu_kernels.ops.int5_tiles() else {}
    assert {n: methods[n].name for n in EXPECTED} == {n: fmt for n, (_, fmt) in EXPECTED.items()} | int5
    assert (packed.engine.runner.native_decoder is not None) == f32_groups
    got, got_tokens = run(packed)

    def emulated(linear: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
        method, x = linear.method, args[0]
        panels, rows = method.panels, x.shape[0]
        group = panels.x_group(rows) if panels is not None else method._gemv_x_group()
        xr = packing.round_to_int8_groups(x, group) if group else x.float()
        w = method.dequantize(torch.float32)
        if panels is not None and panels.amx_at(rows):  # NOTE: AMX tiles read the weight widened to bf16
            w = w.to(torch.bfloat16).float()
        return F.linear(xr, w).to(out.dtype)

    packed.engine.runner.native_decoder = None
    for module in packed.engine.runner.model.modules():
        if isinstance(module, Linear):
            module.register_forward_hook(emulated)
    exact, exact_tokens = run(packed)
    assert (got - exact).abs().max().item() <= 0.05, (got - exact).abs()
    assert got_tokens == exact_tokens
    del packed
    monkeypatch.setenv("PAGODA_DISABLE_CPU_KERNELS", "1")
    monkeypatch.setattr("pagoda.layers.cpu_kernels._library", None)
    monkeypatch.setattr("pagoda.layers.cpu_kernels._loaded", True)
    want, _ = run(LLM(str(path), dtype="float32", num_kv_blocks=32, max_model_len=128))
    assert (got - want).abs().max().item() <= 0.3, (got - want).abs()


@pytest.fixture(params=["vpdpbusd", "amx"])
def same_integer_tiles(request: pytest.FixtureRequest) -> Iterator[str]:
    """int8 and int4-layout panels (int5's too) on the same tiles at every row count: vpdpbusd
    (x rounded to int8 codes) or, where granted, AMX (x as it is); the start's measured choice,
    which may put the two kinds on different tiles at some rows, restored after."""
    before = dict(cpu_kernels.ops.GEMM_AMX_INTEGER_ROWS)
    rows = 1 if request.param == "amx" else 1 << 62
    granted = [cpu_kernels.ops.set_gemm_amx_integer_rows(bits, rows) for bits in (8, 4)]
    try:
        if request.param == "amx" and not all(granted):
            pytest.skip("this CPU or build has no AMX tiles (amx_bf16), or Linux refused the tile data")
        yield request.param
    finally:
        for bits, was in before.items():
            cpu_kernels.ops.set_gemm_amx_integer_rows(bits, was)


@pytest.mark.skipif(not (cpu_kernels.available() and cpu_kernels.ops.int5_tiles()),
                    reason="needs int5 panels (the avx512bf16 kernels)")
def test_q5_0_layers_on_int5_panels_give_the_int8_panels_tokens(tmp_path: Path, monkeypatch,
                                                                 same_integer_tiles: str) -> None:
    """Q5_0 layers (qkv, o, gate/up) as int5 panels, 5 bits a weight: the weight memory shrinks by
    3 bits a weight and the model's prompt logprobs and greedy tokens are those of the same file
    on int8 panels (`int5_tiles` off), exactly, where both kinds run on the same tiles (the same
    products: test_quantization_kernels; AMX's widened weights and vpdpbusd's rounded x differ)."""
    from pagoda import LLM, SamplingParams
    from pagoda.layers.quantization import method_bytes
    from pagoda.models import loader

    path = tmp_path / "q5_0.gguf"
    write_tiny_gguf(path, [("Q5_0", "Q5_0", "Q5_0", "Q5_0", "Q5_0", "Q5_0", "Q4_K")] * 2)
    write_config_and_tokenizer(tmp_path / "hf")
    monkeypatch.setattr(loader, "gguf_metadata_dir", lambda p: tmp_path / "hf")
    prompt = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=0, ignore_eos=True)

    def run() -> tuple[list[float], list[int], dict[str, str], int]:
        llm = LLM(str(path), quantization="gguf", dtype="bfloat16", num_kv_blocks=32, max_model_len=128)
        model = llm.engine.runner.model
        linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert out.prompt_logprobs is not None and llm.engine.runner.native_decoder is not None
        logprobs = [out.prompt_logprobs[i][t].logprob for i, t in enumerate(prompt) if i]  # type: ignore[index]
        names = {n: m.method.name for n, m in linears.items()}
        return logprobs, list(out.outputs[0].token_ids), names, method_bytes(model)

    logprobs, tokens, names, size = run()
    monkeypatch.setattr(cpu_kernels.ops, "int5_tiles", lambda: False)
    want_logprobs, want_tokens, want_names, want_size = run()
    assert (logprobs, tokens) == (want_logprobs, want_tokens)
    q5_0 = [n for n in names if "proj" in n and "down" not in n]
    assert len(q5_0) == 6 and all(names[n] == "int5 (group 32)" and want_names[n] == "int8 (group 32)" for n in q5_0)
    # NOTE: 3 bits a weight fewer (each layer's rows a multiple of 32: no padding)
    weights = 2 * (HIDDEN * (256 + 128 + 128) + 256 * HIDDEN + 2 * INTERMEDIATE * HIDDEN)
    assert want_size - size == weights * 3 // 8
