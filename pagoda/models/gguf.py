"""Reading a GGUF file: tensors dequantized and renamed to Hugging Face names.

Config, tokenizer and chat template come from the GGUF metadata through transformers' own
GGUF support; the tensors are read here with the `gguf` package so that only what the model
needs is materialised (`GGUFIndex` reads the tensor table; `gguf` dequantizes any kind it
knows: Q4_0 ... Q8_0, the k-quants, F16, F32). llama.cpp stores Llama-architecture q/k
projections permuted for its rotary layout; they are permuted back. Gemma 3 names its four
norms of a layer its own way and stores each norm weight as 1 + w (Hugging Face's w, for
x * (1 + w)); the 1 is taken back off.
With `packed` names (quantization='gguf', see layers/quantization/gguf.py), those Q4_0, Q4_1
and Q8_0 tensors are not dequantized: each yields its integer codes under its own name, and
its block scales d (and offsets m: Q4_1's m, Q4_0's -8d) as `<name>_scale` / `<name>_zero`,
[rows, columns / 32]; rows are un-permuted like the weight's.
"""

from __future__ import annotations

import functools
import os
import re
import warnings
from collections.abc import Iterator

import numpy as np
import torch

from pagoda.models.gguf_index import GGUFIndex

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


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


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


# bytes per block of 32, and where the codes start, for the kinds kept packed
_BLOCKS = {"Q4_0": (18, 2), "Q4_1": (20, 4), "Q8_0": (34, 2)}


def unpack_blocks(raw: np.ndarray, kind: str, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A Q4_0/Q4_1/Q8_0 tensor's raw blocks -> (codes [rows, cols], d, m [rows, cols / 32]).

    Q4 codes are in [0, 15] with w = q * d + m (Q4_0: m = -8d); Q8_0 codes are int8, w = q * d.
    """
    size, start = _BLOCKS[kind]
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, size)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(rows, -1)
    qs = blocks[:, start:]
    if kind == "Q8_0":
        return qs.copy().view(np.int8).astype(np.float32).reshape(rows, -1), d, None
    codes = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.float32).reshape(rows, -1)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(rows, -1) if kind == "Q4_1" else -8 * d
    return codes, d, m


def dequantize_blocks(raw: np.ndarray, kind: str, rows: int) -> np.ndarray:
    """A Q4_0/Q4_1/Q8_0 tensor's raw blocks as float32 [rows, cols]: the `gguf` package's own
    formulas, bit for bit, in torch over the whole tensor (the package's numpy loop over row
    groups took 2-3 s of SmolLM2's start-up)."""
    size, start = _BLOCKS[kind]
    with warnings.catch_warnings():
        # NOTE: a read-only view of the mapped file: only read here, never written.
        warnings.simplefilter("ignore", UserWarning)
        blocks = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1, size))
    d = blocks[:, :2].contiguous().view(torch.float16).float()
    qs = blocks[:, start:]
    if kind == "Q8_0":
        w = qs.contiguous().view(torch.int8).float() * d
    else:
        q = torch.cat([qs & 15, qs >> 4], dim=1).float()
        if kind == "Q4_0":
            w = d * (q - 8)
        else:
            w = d * q + blocks[:, 2:4].contiguous().view(torch.float16).float()
    return w.reshape(rows, -1).numpy()


def iter_gguf_weights(path: str, packed: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (Hugging Face name, float32 tensor) for every tensor the model uses.

    Args:
        packed: tensors (HF names without 'model.') to yield as codes and scales instead.
    """
    from gguf.quants import dequantize

    reader = _reader(path)
    arch = _architecture(reader)
    n_head = int(reader.fields[f"{arch}.attention.head_count"])
    n_kv = int(reader.fields.get(f"{arch}.attention.head_count_kv") or n_head)
    for tensor in reader.tensors:
        name = hf_name(tensor.name, arch)
        if name is None:
            continue
        shape = tuple(reversed([int(x) for x in tensor.shape]))
        if packed and name.removeprefix("model.") in packed:
            codes, d, m = unpack_blocks(tensor.data, tensor.tensor_type.name, shape[0])
            parts = {name: codes, f"{name}_scale": d}
            if m is not None:
                parts[f"{name}_zero"] = m
        else:
            kind = tensor.tensor_type.name
            array = (dequantize_blocks(tensor.data, kind, shape[0]) if kind in _BLOCKS else
                     np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)).reshape(shape)
            if arch in _NORMS_PLUS_ONE and name.endswith("norm.weight"):
                array = array - 1
            parts = {name: array}
        for part, array in parts.items():
            yield part, torch.from_numpy(np.array(_unpermuted(array, name, arch, n_head, n_kv), copy=True))


def _unpermuted(array: np.ndarray, name: str, arch: str, n_head: int, n_kv: int) -> np.ndarray:
    if arch in _PERMUTED_ARCHS and ".q_proj." in name:
        return _unpermute(array, n_head)
    if arch in _PERMUTED_ARCHS and ".k_proj." in name:
        return _unpermute(array, n_kv)
    return array
