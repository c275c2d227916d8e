"""What pagoda refuses about a model, clearly: architectures it lacks, heads its kernels cannot
take (issue 25)."""

from __future__ import annotations

import types

import pytest
import torch

from pagoda.layers.attention import PagedAttention
from pagoda.layers.attention_backend import NativeAttentionBackend, TorchAttentionBackend
from pagoda.model_runner import attention_backend_for
from pagoda.models.registry import resolve_architecture


@pytest.mark.parametrize("config, named", [
    (types.SimpleNamespace(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3"),
     "Gemma3ForConditionalGeneration"),
    # NOTE: a config read from GGUF metadata names a model type and no architecture
    (types.SimpleNamespace(architectures=None, model_type="phi3"), "model_type 'phi3'"),
])
def test_an_unknown_architecture_is_named_with_the_supported_ones(config, named):
    with pytest.raises(ValueError, match="Unsupported model architecture") as info:
        resolve_architecture(config)
    message = str(info.value)
    assert named in message and "LlamaForCausalLM" in message and "qwen3" in message
    assert "Gemma3ForCausalLM" in message and "gemma3_text" in message


def test_heads_wider_than_the_kernels_take_stay_on_torch():
    """attention.cpp holds at most 256 values of a head in registers; a model with a wider head
    (none of today's models) must never reach it: the runner picks torch's backend."""
    def model(*head_dims: int) -> types.SimpleNamespace:
        layers = [PagedAttention(4, 1, d) for d in head_dims]
        return types.SimpleNamespace(attention_layers=lambda: layers)

    cpu = torch.device("cpu")
    assert isinstance(attention_backend_for(model(256, 256), 16, cpu, True), NativeAttentionBackend)  # type: ignore[arg-type]
    for m, native in ((model(256, 320), True), (model(256, 256), False)):
        assert isinstance(attention_backend_for(m, 16, cpu, native), TorchAttentionBackend)  # type: ignore[arg-type]


@pytest.mark.parametrize("arch", ["llama", "llama3", "gemma3", "qwen3_moe"])
def test_every_architecture_builds_on_another_device(arch, tiny_model_factory):
    """Models are built under the engine's device (`load_model`); a table made on the CPU by a
    library (transformers' scaled ropes) once broke every llama3 and Gemma 3 build on CUDA.
    The meta device stands in for the GPU here: any tensor left on the CPU fails the build."""
    from transformers import AutoConfig

    from pagoda.distributed.group import SINGLE, WHOLE

    config = AutoConfig.from_pretrained(tiny_model_factory(arch))
    cls, flags = resolve_architecture(config)
    with torch.device("meta"):
        model = cls(config, flags, 64, SINGLE, WHOLE)
    assert {b.device.type for b in model.buffers()} | {p.device.type for p in model.parameters()} == {"meta"}
