"""GPTQ and AWQ checkpoints loaded onto int4 records (layers/quantization/gptq_awq.py).

A tiny random Llama is quantized here, per group, into each format's tensors by packers
written from the formats' specs (not from pagoda's unpackers), and saved as safetensors with
its `quantization_config`; the same weights dequantized, (q - z) * s in fp32, are saved as a
plain float checkpoint. Then:
- every packed layer dequantizes to the reference: bit for bit where z * s is an f16 value
  (always for symmetric GPTQ, z = 8), else within half an f16 ulp of z * s (the records'
  offset m = -z * s is f16);
- greedy generation in fp32 (torch path) equals the float checkpoint's token for token, and
  every prompt logprob is within 0.03 of it (the int4 product rounds x to bf16, and m is f16);
  on the native kernels (bf16, x rounded to int8 codes) within 0.15;
- act order (GPTQ's desc_act: each group's input columns scattered by `g_idx`) loads the same
  way, its layers gathering x's columns (the fused parts share one order, as GPTQ makes them);
- bad configs and a g_idx whose groups are not group_size wide are clear errors.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch

from pagoda.layers.linear import Linear
from pagoda.layers.quantization.gptq_awq import checkpoint_quantization, resolve_quantization
from pagoda.layers.quantization.methods import InputPermutedMethod, PackedLinearMethod

VOCAB, HIDDEN, INTERMEDIATE, LAYERS = 96, 128, 256, 2
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of a word holds column AWQ_ORDER[i]


def pack_words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 8] integers in [0, 15] -> int32 words, element i at bits 4i."""
    words = sum(nibbles[..., i].to(torch.int64) << (4 * i) for i in range(8))
    return torch.as_tensor(words).to(torch.int64).sub((words >= 2**31).to(torch.int64) << 32).to(torch.int32)


def quantize_groups(w: torch.Tensor, group_size: int, sym: bool, min_zero: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> q [N, K], z [G, N], s f16 [G, N] by round to nearest per group of K."""
    n, k = w.shape
    groups = w.float().reshape(n, k // group_size, group_size)
    if sym:
        s = (groups.abs().amax(-1) * 2 / 15).to(torch.float16)
        z = torch.full(s.shape, 8, dtype=torch.int64)
    else:
        low, high = groups.amin(-1), groups.amax(-1)
        s = ((high - low) / 15).to(torch.float16)
        z = torch.round(-low / s.float()).clamp(min_zero, 15).to(torch.int64)
    q = (torch.round(groups / s.float()[..., None]) + z[..., None]).clamp(0, 15).to(torch.int64)
    return q.reshape(n, k), z.t().contiguous(), s.t().contiguous()


def gptq_tensors(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, group_size: int, v2: bool,
                 g_idx: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    n, k = q.shape
    stored = z if v2 else (z - 1) & 15  # NOTE: v1 stores z - 1
    return {"qweight": pack_words(q.t().reshape(k // 8, 8, n).transpose(1, 2)),
            "qzeros": pack_words(stored.reshape(z.shape[0], n // 8, 8)),
            "scales": s, "g_idx": torch.arange(k, dtype=torch.int32) // group_size if g_idx is None else g_idx}


def awq_tensors(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor) -> dict[str, torch.Tensor]:
    n, k = q.shape
    order = list(AWQ_ORDER)
    return {"qweight": pack_words(q.t().reshape(k, n // 8, 8)[..., order]),
            "qzeros": pack_words(z.reshape(z.shape[0], n // 8, 8)[..., order]), "scales": s}


def write_model(out: Path, tensors: dict[str, torch.Tensor], quantization_config: dict | None) -> Path:
    from safetensors.torch import save_file
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
                rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                architectures=["LlamaForCausalLM"]).save_pretrained(out)
    if quantization_config is not None:
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = Whitespace()  # type: ignore[assignment]
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w1", eos_token="w2").save_pretrained(out)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(out / "model.safetensors"))
    return out


FORMATS = {
    "gptq-sym-g32": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False}, True),
    "gptq-asym-g128": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False, "desc_act": False}, False),
    "awq-g64": ({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"}, False),
    "gptq-act-g32": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": True}, False),
}
# NOTE: act order: the layers that read one input share its column order (GPTQ sorts by the input's Hessian)
INPUTS = {"self_attn.q_proj": "attn", "self_attn.k_proj": "attn", "self_attn.v_proj": "attn", "self_attn.o_proj": "o",
          "mlp.gate_proj": "mlp", "mlp.up_proj": "mlp", "mlp.down_proj": "down"}


def checkpoints(root: Path, name: str) -> tuple[Path, Path, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The quantized checkpoint, its float twin, and per linear (reference weight, z * s)."""
    config, sym = FORMATS[name]
    gen = torch.Generator().manual_seed(0)
    floats: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=gen) * 0.3,
        "model.norm.weight": 1 + 0.1 * torch.randn(HIDDEN, generator=gen),
        "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=gen) * 0.1}
    quantized = dict(floats)
    reference = {}
    for layer in range(LAYERS):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            floats[f"model.layers.{layer}.{norm}.weight"] = 1 + 0.1 * torch.randn(HIDDEN, generator=gen)
            quantized[f"model.layers.{layer}.{norm}.weight"] = floats[f"model.layers.{layer}.{norm}.weight"]
        for linear in LINEARS:
            rows, cols = {"self_attn.k_proj": (HIDDEN // 2, HIDDEN), "self_attn.v_proj": (HIDDEN // 2, HIDDEN),
                          "mlp.gate_proj": (INTERMEDIATE, HIDDEN), "mlp.up_proj": (INTERMEDIATE, HIDDEN),
                          "mlp.down_proj": (HIDDEN, INTERMEDIATE)}.get(linear, (HIDDEN, HIDDEN))
            w = torch.randn(rows, cols, generator=gen) * 0.15
            gs = config["group_size"]
            # NOTE: act order quantizes the columns in `order`, group by group; identity otherwise
            # (seeded by crc32, not hash(): str hashes differ between processes, and so did the model)
            seed = zlib.crc32(f"{layer}.{INPUTS[linear]}".encode())
            order = (torch.randperm(cols, generator=torch.Generator().manual_seed(seed))
                     if config.get("desc_act") else torch.arange(cols))
            q_in_order, z, s = quantize_groups(w[:, order], gs, sym, min_zero=1 if name.startswith("gptq") else 0)
            q = torch.empty_like(q_in_order)
            q[:, order] = q_in_order
            g_idx = torch.empty(cols, dtype=torch.int32)
            g_idx[order] = (torch.arange(cols) // gs).to(torch.int32)
            z_full, s_full = z.t()[:, g_idx.long()], s.t().float()[:, g_idx.long()]
            prefix = f"model.layers.{layer}.{linear}"
            floats[f"{prefix}.weight"] = (q - z_full).float() * s_full
            reference[f"layers.{layer}.{linear}"] = (floats[f"{prefix}.weight"], z_full.float() * s_full)
            packed = gptq_tensors(q, z, s, gs, v2=False, g_idx=g_idx) if name.startswith("gptq") \
                else awq_tensors(q, z, s)
            quantized.update({f"{prefix}.{part}": t for part, t in packed.items()})
            if name.startswith("gptq"):
                quantized[f"{prefix}.bias"] = torch.zeros(rows, dtype=torch.float16)  # AutoGPTQ's
    return (write_model(root / name, quantized, config), write_model(root / f"{name}-float", floats, None),
            reference)


def fused_reference(reference: dict[str, tuple[torch.Tensor, torch.Tensor]], name: str
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    parent, _, leaf = name.rpartition(".")
    sources = [f"{parent}.{p}" for p in parts.get(leaf, (leaf,))]
    return (torch.cat([reference[s][0] for s in sources]), torch.cat([reference[s][1] for s in sources]))


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory):
    root, cache = tmp_path_factory.mktemp("gptq_awq"), {}

    def get(name: str) -> tuple[Path, Path, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        if name not in cache:
            cache[name] = checkpoints(root, name)
        return cache[name]

    return get


@pytest.fixture
def torch_path(monkeypatch) -> None:
    """The torch path: the float model multiplies x as it is in fp32 (the AVX2 kernels would
    round it to int8 codes), int4 records after rounding it to bf16."""
    monkeypatch.setenv("PAGODA_DISABLE_CPU_KERNELS", "1")
    monkeypatch.setattr("pagoda.layers.cpu_kernels._library", None)
    monkeypatch.setattr("pagoda.layers.cpu_kernels._loaded", True)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_packed_layers_dequantize_to_the_reference(name: str, written) -> None:
    from pagoda.layers.quantization import finish_gguf
    from pagoda.models.loader import load_hf_config, load_model

    packed_dir, _, reference = written(name)
    model = load_model(str(packed_dir), load_hf_config(str(packed_dir)), torch.float32, torch.device("cpu"), 64)
    report = finish_gguf(model, name[:4])  # as engine_setup finishes a packed load
    assert (report.num_quantized, report.num_kept) == (4 * LAYERS, 1)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    assert not isinstance(linears.pop("lm_head").method, PackedLinearMethod)  # the checkpoint's float head
    assert len(linears) == 4 * LAYERS
    config, sym = FORMATS[name]
    for layer_name, layer in linears.items():
        method = layer.method
        assert isinstance(method, InputPermutedMethod) == bool(config.get("desc_act"))
        inner = method.inner if isinstance(method, InputPermutedMethod) else method
        assert isinstance(inner, PackedLinearMethod)
        assert (inner.scheme, inner.group_size, inner.offsets) == ("int4", config["group_size"], None)
        assert not layer.weight.numel() and layer.weight.dtype == torch.uint8  # codes loaded as bytes, freed
        got, (want, zs) = method.dequantize(torch.float32), fused_reference(reference, layer_name)
        exact = zs.to(torch.float16).float() == zs
        assert torch.equal(got[exact], want[exact]), layer_name
        assert ((got - want).abs() <= zs.abs() * 2**-11).all(), layer_name  # half an f16 ulp of z * s
        assert exact.all() or not sym


@pytest.mark.parametrize("name", ["awq-g64", "gptq-asym-g128", "gptq-act-g32"])
def test_generation_equals_the_dequantized_float_model(name: str, written, torch_path) -> None:
    from pagoda import LLM, SamplingParams

    packed_dir, float_dir, _ = written(name)
    engine = dict(dtype="float32", num_kv_blocks=16, max_model_len=64)
    packed, plain = LLM(str(packed_dir), **engine), LLM(str(float_dir), **engine)
    prompt = torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    want, got = (llm.generate([prompt], params, use_tqdm=False)[0] for llm in (plain, packed))
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert want.prompt_logprobs is not None and got.prompt_logprobs is not None
    # NOTE: measured 0.018 (AWQ here): 0.004 from the f16 offsets alone (x unrounded), the rest
    # from the int4 product's bf16-rounded x. A wrong nibble, zero or scale moves them by far more.
    diffs = [abs(got.prompt_logprobs[i][t].logprob - want.prompt_logprobs[i][t].logprob)  # type: ignore[index]
             for i, t in enumerate(prompt) if i]
    assert max(diffs) <= 0.03, diffs


@pytest.mark.parametrize("name", ["awq-g64", "gptq-act-g32"])
def test_generation_on_the_native_kernels(name: str, written) -> None:
    """The default path here (the CPU kernels' int4 GEMV, bf16): the same records, x rounded
    to int8 codes by groups of 32 on AVX2; measured 0.06 from the float model (AWQ, bf16).
    Act order's layers gather x's columns, inside the native decoder stack too: the stack's
    tokens and logprobs are the layer path's exactly."""
    from pagoda import LLM, SamplingParams
    from pagoda.layers import cpu_kernels

    if cpu_kernels.library() is None:
        pytest.skip("no CPU kernels")
    packed_dir, float_dir, _ = written(name)
    engine = dict(dtype="bfloat16", num_kv_blocks=16, max_model_len=64, enable_prefix_caching=False)
    packed, plain, layered = (LLM(str(d), **engine) for d in (packed_dir, float_dir, packed_dir))
    runner = packed.engine.runner
    assert runner.native_decoder is not None, runner.native_refusal
    layered.engine.runner.native_decoder = None
    prompt = torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    want, got, by_layers = (llm.generate([prompt], params, use_tqdm=False)[0] for llm in (plain, packed, layered))
    assert len(got.outputs[0].token_ids) == 8
    diffs = [abs(got.prompt_logprobs[i][t].logprob - want.prompt_logprobs[i][t].logprob)  # type: ignore[index]
             for i, t in enumerate(prompt) if i]
    assert max(diffs) <= 0.15, diffs
    assert got.outputs[0].token_ids == by_layers.outputs[0].token_ids
    assert got.prompt_logprobs == by_layers.prompt_logprobs


def config_with(quantization_config: dict | None) -> object:
    from types import SimpleNamespace

    return SimpleNamespace(quantization_config=quantization_config)


@pytest.mark.parametrize(("config", "message"), [
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "only 4-bit"),
    ({"quant_method": "gptq", "bits": 4, "group_size": -1}, "group_size must be one of (32, 64, 128)"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "'gemm' layout"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point=false"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
])
def test_unsupported_configs_are_clear_errors(config: dict, message: str) -> None:
    with pytest.raises(ValueError) as e:
        checkpoint_quantization(config_with(config))
    assert message in str(e.value)


def test_quantization_is_found_from_the_config_and_may_not_contradict_it() -> None:
    gptq = config_with({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "gptq_v2"})
    assert resolve_quantization(None, gptq) == resolve_quantization("gptq", gptq) == "gptq"
    assert checkpoint_quantization(gptq).zero_offset == 0  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="GPTQ-quantized .* quantization='int4'"):
        resolve_quantization("int4", gptq)
    with pytest.raises(ValueError, match="quantization='awq' needs a AWQ checkpoint"):
        resolve_quantization("awq", config_with(None))
    assert resolve_quantization("int8", config_with(None)) == "int8"


@pytest.mark.parametrize("g_idx_first", [True, False])
def test_act_order_loads_whatever_the_tensors_order(g_idx_first: bool) -> None:
    """The layer waits for its g_idx (named in the checkpoint) before or after its other
    tensors; its codes come back in group order with the permutation; groups of the wrong
    width are refused."""
    from pagoda.layers.quantization.gptq_awq import CheckpointQuant, iter_checkpoint_weights

    q, z, s = quantize_groups(torch.randn(64, 64), 32, True, 1)
    tensors = gptq_tensors(q, z, s, 32, v2=False)
    tensors["g_idx"] = tensors["g_idx"].flip(0)
    names = sorted(tensors, key=lambda k: (k != "g_idx") == g_idx_first)
    quant = CheckpointQuant("gptq", 32, 1)
    out = dict(iter_checkpoint_weights(iter((f"x.{k}", tensors[k]) for k in names), quant,
                                       [f"x.{k}" for k in names]))
    perm = out["x.input_perm"]
    assert torch.equal(perm, torch.arange(64).flip(0).reshape(2, 32).flip(1).flatten())  # group 0's columns first
    assert torch.equal(out["x.weight"], q[:, perm].to(torch.uint8))
    tensors["g_idx"] = torch.tensor([0] * 40 + [1] * 24, dtype=torch.int32)
    with pytest.raises(ValueError, match="does not put 32 input columns in each group"):
        list(iter_checkpoint_weights(iter((f"x.{k}", tensors[k]) for k in names), quant, [f"x.{k}" for k in names]))


def test_cli_names() -> None:
    from pagoda.config import EngineConfig

    assert EngineConfig.from_kwargs("m", quantization="gptq").model.quantization == "gptq"
    assert EngineConfig.from_kwargs("m", quantization="awq").model.quantization == "awq"


# NOTE: two worker processes: about 30 s on a loaded 2-core machine. `pytest -m slow` runs it.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["gptq-sym-g32", "awq-g64"])
def test_tensor_parallel_shards_equal_one_process(name: str, written, torch_path) -> None:
    """Codes, scales and offsets narrowed by the column- and row-parallel loaders (as GGUF's)."""
    from pagoda import LLM, SamplingParams

    packed_dir, _, _ = written(name)
    engine = dict(dtype="float32", num_kv_blocks=16, max_model_len=64)
    prompt = torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = LLM(str(packed_dir), **engine).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(str(packed_dir), tensor_parallel_size=2, **engine)
    try:
        assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == want
    finally:
        llm.engine.shutdown()


def test_an_older_checkpoints_own_config_file_is_read(written, tmp_path: Path) -> None:
    """AutoGPTQ's quantize_config.json beside a config.json without quantization_config."""
    from pagoda.models.loader import load_hf_config

    packed_dir, _, _ = written("gptq-sym-g32")
    config = json.loads((packed_dir / "config.json").read_text())
    (tmp_path / "quantize_config.json").write_text(json.dumps(config.pop("quantization_config")))
    (tmp_path / "config.json").write_text(json.dumps(config))
    quant = checkpoint_quantization(load_hf_config(str(tmp_path)))
    assert quant is not None and (quant.method, quant.group_size, quant.zero_offset) == ("gptq", 32, 1)
