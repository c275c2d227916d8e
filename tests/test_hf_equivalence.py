"""Greedy output token-for-token equal to Hugging Face transformers on the same weights."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy_generate

from pagoda import LLM, SamplingParams

PROMPT_LENS = [5, 17, 33, 64, 3, 41]
MAX_TOKENS = 24


def _prompts(n: int = len(PROMPT_LENS)) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(100, 49000, (n_tok,), generator=g).tolist() for n_tok in PROMPT_LENS[:n]]


def hf_greedy(model_dir, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return hf_greedy_generate(model, prompts, max_tokens)


def pagoda_greedy(model_dir, prompts, max_tokens, **engine_args) -> list[list[int]]:
    return llm_greedy(LLM(str(model_dir), dtype="float32", **engine_args), prompts, max_tokens)


def llm_greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """`llm`'s greedy tokens for `prompts`; the pool's invariants checked after."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.check_integrity()
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def references(tiny_model_factory):
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = hf_greedy(tiny_model_factory(arch), _prompts(), MAX_TOKENS)
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "qwen3", "mistral", "mistral_swa", "phi3"])
def test_mixed_batch_matches_hf(arch, tiny_model_factory, references):
    got = pagoda_greedy(tiny_model_factory(arch), _prompts(), MAX_TOKENS, num_kv_blocks=64)
    assert got == references(arch)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_chunked_prefill_and_block_sizes(block_size, tiny_model_factory, references):
    got = pagoda_greedy(tiny_model_factory("llama"), _prompts(), MAX_TOKENS, block_size=block_size,
                        max_num_batched_tokens=16, num_kv_blocks=2048 // block_size)
    assert got == references("llama")


def test_preemption_keeps_outputs(tiny_model_factory, references):
    # NOTE: 12 blocks of 16 = 192 slots for six requests needing up to 88 tokens each.
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", num_kv_blocks=12, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == references("llama")
    assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.check_integrity()


def test_torch_attention_fallback_matches_hf(tiny_model_factory, references, monkeypatch):
    from pagoda.layers import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    for arch in ("llama", "mistral_swa"):
        got = pagoda_greedy(tiny_model_factory(arch), _prompts(), MAX_TOKENS, num_kv_blocks=64,
                            max_num_batched_tokens=32)
        assert got == references(arch), arch


def test_unwritten_slots_are_never_read(tiny_model_factory, references):
    # NOTE: the CPU pool is left uninitialised (torch.empty); poison it to prove no read
    # of a slot that was never written can reach the output.
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32)
    if llm.engine.runner.attention_backend.zeroed_pool:
        pytest.skip("torch's attention (CUDA, or no kernels) reads padded slots of a zeroed pool, masked")
    for kv in llm.engine.runner.kv_caches.values():
        kv.k.fill_(float("nan"))
        kv.v.fill_(float("nan"))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == references("llama")


def test_hf_overrides_reach_the_model_as_transformers_reads_them(tiny_model_factory, tmp_path):
    """vLLM's --hf-overrides (and its older --rope-theta / --rope-scaling): the keys laid over
    config.json; greedy output equals transformers' on a config with the same keys, and differs
    from the model without them (so the override took effect)."""
    import shutil

    from transformers import AutoConfig

    from pagoda.models.loader import apply_hf_overrides

    source = tiny_model_factory("llama")
    overrides = {"rope_theta": 50.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    changed = tmp_path / "overridden"
    shutil.copytree(source, changed)
    config = AutoConfig.from_pretrained(changed)
    apply_hf_overrides(config, overrides)
    assert config.rope_parameters["rope_theta"] == 50.0 and config.rope_parameters["factor"] == 4.0
    config.save_pretrained(changed)
    prompts = _prompts(3)
    expected = hf_greedy(changed, prompts, MAX_TOKENS)
    assert expected != hf_greedy(source, prompts, MAX_TOKENS)
    assert pagoda_greedy(source, prompts, MAX_TOKENS, num_kv_blocks=64, hf_overrides=overrides) == expected


def test_hf_overrides_refuse_rope_keys_a_per_layer_config_cannot_take():
    from transformers import Gemma3TextConfig

    from pagoda.config import ModelConfig
    from pagoda.models.loader import apply_hf_overrides

    with pytest.raises(ValueError, match="per layer type; override 'rope_parameters' whole"):
        apply_hf_overrides(Gemma3TextConfig(), {"rope_theta": 1.0})
    assert ModelConfig(hf_overrides='{"max_position_embeddings": 64}').hf_overrides == {"max_position_embeddings": 64}
    with pytest.raises(ValueError, match="hf_overrides"):
        ModelConfig(hf_overrides="[1]")  # type: ignore[arg-type]


def test_rope_the_tables_cannot_hold_is_refused_by_name():
    from transformers import Phi3Config

    from pagoda.layers.rotary import inv_freq_for

    with pytest.raises(ValueError, match="partial_rotary_factor 0.75"):
        inv_freq_for(Phi3Config(partial_rotary_factor=0.75), 64)
    long = Phi3Config(max_position_embeddings=8192, original_max_position_embeddings=4096, hidden_size=256,
                      num_attention_heads=4, rope_scaling={"type": "longrope", "short_factor": [1.0] * 32,
                                                           "long_factor": [2.0] * 32})
    with pytest.raises(ValueError, match="'longrope'"):
        inv_freq_for(long, 64)


@pytest.mark.parametrize("tokens", [1, 7])
def test_q_and_k_side_by_side_rotate_as_one_bit_for_bit(tokens):
    """The torch path (CUDA's) rotates q and k as one tensor when the fused projection left them
    side by side (half the launches): bit for bit what rotating each gives, one token too
    (whose views may carry any first stride); apart, or after q/k norms, each on its own."""
    from pagoda.layers.rotary import RotaryInputs, _adjacent_heads, apply_rotary

    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (4 + 2 + 2) * 16, generator=g).to(torch.bfloat16)
    q, k, v = qkv.split([64, 32, 32], dim=-1)
    q, k, v = q.view(-1, 4, 16), k.view(-1, 2, 16), v.view(-1, 2, 16)
    cos, sin = torch.randn(tokens, 1, 16, generator=g).bfloat16(), torch.randn(tokens, 1, 16, generator=g).bfloat16()
    assert _adjacent_heads(q, k) is not None
    got_q, got_k = RotaryInputs(torch.arange(tokens), cos, sin).apply(q, k)
    assert torch.equal(got_q, apply_rotary(q, cos, sin)) and torch.equal(got_k, apply_rotary(k, cos, sin))
    assert _adjacent_heads(q, v) is None and _adjacent_heads(k, q) is None
    # NOTE: two tensors end to end in memory but in separate storages (what CUDA's caching
    # allocator made of Qwen3's normed q and k) are not one view: q's storage ends before k.
    memory = bytearray(qkv[:, :96].float().contiguous().numpy().tobytes())
    apart_q = torch.frombuffer(memory, dtype=torch.float32, count=tokens * 64).view(-1, 4, 16)
    apart_k = torch.frombuffer(memory, dtype=torch.float32, offset=tokens * 64 * 4, count=tokens * 32)
    apart_k = apart_k.view(-1, 2, 16)
    assert apart_k.data_ptr() == apart_q.data_ptr() + apart_q.nbytes
    assert _adjacent_heads(apart_q, apart_k) is None
