"""Reading a GGUF file: tensors dequantized and renamed to Hugging Face names.

Config, tokenizer and chat template come from the GGUF metadata through transformers' own
GGUF support; the tensors are read here with the `gguf` package so that only what the model
needs is materialised. llama.cpp stores Llama-architecture q/k projections permuted for its
rotary layout; they are permuted back.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PERMUTED_ARCHS = {"llama", "mistral"}


def hf_name(gguf_name: str) -> str | None:
    """Maps 'blk.3.attn_q.weight' to 'model.layers.3.self_attn.q_proj.weight'."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if not m or m.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)  # type: ignore[attr-defined]
    if f is None:
        return None
    return f.contents()


def iter_gguf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (Hugging Face name, float32 tensor) for every tensor the model uses."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    arch = str(_field(reader, "general.architecture"))
    n_head = int(_field(reader, f"{arch}.attention.head_count"))
    n_kv = int(_field(reader, f"{arch}.attention.head_count_kv") or n_head)
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        array = dequantize(tensor.data, tensor.tensor_type)
        array = np.asarray(array, dtype=np.float32).reshape(tuple(reversed([int(x) for x in tensor.shape])))
        if arch in _PERMUTED_ARCHS and ".q_proj." in name:
            array = _unpermute(array, n_head)
        elif arch in _PERMUTED_ARCHS and ".k_proj." in name:
            array = _unpermute(array, n_kv)
        yield name, torch.from_numpy(np.array(array, copy=True))
