"""Maps Hugging Face architecture names to a model class and its flags."""

from __future__ import annotations

from pagoda.models.gemma3 import Gemma3ForCausalLM
from pagoda.models.llama import LlamaFlags, LlamaForCausalLM
from pagoda.models.moe import MoeForCausalLM

# NOTE: the model classes the engine runs; they share one interface (constructor, forward,
# compute_logits, attention_layers, has_checkpoint_tensor, dims, packed_modules).
CausalLM = LlamaForCausalLM | MoeForCausalLM | Gemma3ForCausalLM

_REGISTRY: dict[str, tuple[type[CausalLM], LlamaFlags]] = {
    "LlamaForCausalLM": (LlamaForCausalLM, LlamaFlags()),
    "MistralForCausalLM": (LlamaForCausalLM, LlamaFlags(use_sliding_window=True)),
    "Qwen2ForCausalLM": (LlamaForCausalLM, LlamaFlags(qkv_bias=True)),
    "Qwen3ForCausalLM": (LlamaForCausalLM, LlamaFlags(qk_norm=True)),
    # NOTE: Phi-3's checkpoints hold q/k/v and gate/up already fused (load_weights splits them);
    # a window where its config names one. Hugging Face directories only: a Phi-3 GGUF (its own
    # tensor names) is not mapped, so its model type stays unknown below.
    "Phi3ForCausalLM": (LlamaForCausalLM, LlamaFlags(use_sliding_window=True)),
    "Gemma3ForCausalLM": (Gemma3ForCausalLM, LlamaFlags()),
    "MixtralForCausalLM": (MoeForCausalLM, LlamaFlags(use_sliding_window=True)),
    "Qwen3MoeForCausalLM": (MoeForCausalLM, LlamaFlags(qk_norm=True)),
}

_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "gemma3_text": "Gemma3ForCausalLM"}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def resolve_architecture(config: object) -> tuple[type[CausalLM], LlamaFlags]:
    """Returns the model class and flags for a Hugging Face config.

    Raises:
        ValueError: when no listed architecture is supported.
    """
    archs = list(getattr(config, "architectures", None) or [])
    if not archs and getattr(config, "model_type", None) in _MODEL_TYPES:
        # NOTE: configs read from GGUF metadata name a model_type but no architecture.
        archs = [_MODEL_TYPES[config.model_type]]  # type: ignore[attr-defined]
    for arch in archs:
        if arch in _REGISTRY:
            cls, flags = _REGISTRY[arch]
            return cls, _with_config_flags(flags, config)
    found = archs or [f"model_type {getattr(config, 'model_type', None)!r}"]
    raise ValueError(f"Unsupported model architecture {', '.join(map(str, found))}; "
                     f"pagoda supports {supported_architectures()} (model types {sorted(_MODEL_TYPES)}).")


def _with_config_flags(flags: LlamaFlags, config: object) -> LlamaFlags:
    from dataclasses import replace

    bias = bool(getattr(config, "attention_bias", False))
    return replace(
        flags,
        qkv_bias=flags.qkv_bias or bias,
        o_bias=bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        use_sliding_window=flags.use_sliding_window or bool(getattr(config, "use_sliding_window", False)),
    )
