"""Reading a GGUF file: tensors dequantized and renamed to Hugging Face names.

Config, tokenizer and chat template come from the GGUF metadata through transformers' own
GGUF support; the tensors are read here so that only what the model needs is materialised
(`GGUFIndex` reads the tensor table; `gguf_blocks` decodes Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
Q4_K, Q5_K and Q6_K in torch, bit for bit as the `gguf` package dequantizes them; any other
kind goes through the package). llama.cpp stores Llama-architecture q/k
projections permuted for its rotary layout; they are permuted back. Gemma 3 names its four
norms of a layer its own way and stores each norm weight as 1 + w (Hugging Face's w, for
x * (1 + w)); the 1 is taken back off.
With `packed` tensors (quantization='gguf', see layers/quantization/gguf.py), those are not
dequantized: each yields its int8 codes under its own name, and its group scales d (and
offsets m) in its record format as `<name>_scale` / `<name>_zero`, [rows, columns / group];
rows are un-permuted like the weight's.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagoda.models.gguf_blocks import DECODED_KINDS, decode
from pagoda.models.gguf_index import GGUFIndex

if TYPE_CHECKING:
    from pagoda.layers.quantization.gguf import RecordFormat

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# NOTE: Gemma 3's `ffn_norm` is the norm before the MLP; Llama's is the one after attention.
_ARCH_LAYER_NAMES = {
    "gemma3": {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
}
_NORMS_PLUS_ONE = {"gemma3"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PERMUTED_ARCHS = {"llama", "mistral"}


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """Maps 'blk.3.attn_q.weight' to 'model.layers.3.self_attn.q_proj.weight' (for the GGUF's
    `general.architecture`)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if not m or m.group(2) not in names:
        return None
    return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"


def _architecture(reader: GGUFIndex) -> str:
    return str(reader.fields.get("general.architecture"))


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).transpose(2, 1).reshape(w.shape)


def _reader(path: str) -> GGUFIndex:
    """The file's index, read once per file version in a process (`GGUFIndex`: 0.2 s where
    the `gguf` package's reader took 4.4 s on a Zen 3); engines built again on one file
    (tests, `bench quality`'s schemes, `pagoda tune` then serve) reuse it."""
    st = os.stat(path)
    return _cached_reader(os.path.realpath(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, mtime_ns: int, size: int) -> GGUFIndex:
    return GGUFIndex(path)


def gguf_tensor_types(path: str) -> dict[str, str]:
    """Each model tensor's GGUF kind ('Q4_1', 'F32', ...) by HF name without 'model.'."""
    types = {}
    reader = _reader(path)
    arch = _architecture(reader)
    for tensor in reader.tensors:
        name = hf_name(tensor.name, arch)
        if name is not None:
            types[name.removeprefix("model.")] = tensor.tensor_type.name
    return types


def dequantize_blocks(raw: np.ndarray, kind: str, rows: int) -> np.ndarray:
    """A tensor's raw blocks of a kind in `gguf_blocks.DECODED_KINDS` as float32 [rows, cols]:
    the `gguf` package's own formulas, bit for bit, in torch over the whole tensor (the
    package's numpy loop over row groups took 2-3 s of SmolLM2's start-up)."""
    return decode(raw, kind, rows).dequantize().numpy()


def iter_gguf_weights(path: str, packed: Mapping[str, RecordFormat] | None = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (Hugging Face name, tensor) for every tensor the model uses: float32, or for the
    `packed` ones int8 codes and their fp32 group scales and offsets.

    Args:
        packed: tensors (HF names without 'model.') to yield in a record format instead
            (layers/quantization/gguf.py: `prepare_gguf_load`, `to_format`).
    """
    from gguf.quants import dequantize

    from pagoda.layers.quantization.gguf import to_format

    reader = _reader(path)
    arch = _architecture(reader)
    n_head = int(reader.fields[f"{arch}.attention.head_count"])
    n_kv = int(reader.fields.get(f"{arch}.attention.head_count_kv") or n_head)
    for tensor in reader.tensors:
        name = hf_name(tensor.name, arch)
        if name is None:
            continue
        shape = tuple(reversed([int(x) for x in tensor.shape]))
        kind = tensor.tensor_type.name
        fmt = packed.get(name.removeprefix("model.")) if packed else None
        parts: dict[str, torch.Tensor | None]
        if fmt is not None:
            codes, scale, offset = to_format(decode(tensor.data, kind, shape[0]), fmt)
            parts = {name: codes, f"{name}_scale": scale, f"{name}_zero": offset}
        else:
            if kind in DECODED_KINDS:
                weights = decode(tensor.data, kind, shape[0]).dequantize().view(shape)
            else:
                weights = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32,
                                                    copy=True)).reshape(shape)
            if arch in _NORMS_PLUS_ONE and name.endswith("norm.weight"):
                weights -= 1
            parts = {name: weights}
        for part, t in parts.items():
            if t is not None:
                yield part, _unpermuted(t, name, arch, n_head, n_kv).contiguous()
    reader.release_pages()


def _unpermuted(array: torch.Tensor, name: str, arch: str, n_head: int, n_kv: int) -> torch.Tensor:
    if arch in _PERMUTED_ARCHS and ".q_proj." in name:
        return _unpermute(array, n_head)
    if arch in _PERMUTED_ARCHS and ".k_proj." in name:
        return _unpermute(array, n_kv)
    return array
