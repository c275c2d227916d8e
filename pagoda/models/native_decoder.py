"""A step's whole stack of Llama decoder layers as one native call (CPU, bf16).

The layer-by-layer path makes ~10 kernel calls a layer through ctypes and nn.Module, ~2 ms
a step for SmolLM2's 30 layers (docs/performance.md): as much as its attention at one stream.
`pagoda_decoder_stack_bf16` (pagoda/csrc/decoder.cpp) runs the same kernels in the same order
on the same buffers, so its output is bit for bit the layer path's (tested).
`NativeDecoder.build` returns None unless the whole model fits: one process (no tensor or
pipeline parallelism), bf16, every linear on the small-M GEMM's packed weights (bf16, int8 or
int4 panels), no per-head q/k norm (Qwen3), no mixture-of-experts layer, a bf16 or fp8 KV
pool bound. It takes steps of at most `max_rows` rows: as far as every linear's kernel plan (kernel_plan.py) names the GEMM. The model runner
builds it when it binds the KV pool; the model calls it in place of its layer loop for steps
the paged-attention kernel attends whole (on the native path every step: decodes and prefill
chunks alike) of at most `max_rows` rows (`takes`), and runs its layers otherwise.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import nn

from pagoda.layers import cpu_kernels
from pagoda.layers.attention_backend import AttentionMetadata, NativeAttentionMetadata
from pagoda.layers.cpu_kernels import checks
from pagoda.layers.linear import Linear
from pagoda.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
CACHE_KINDS = {torch.bfloat16: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


# NOTE: these mirror the structs of pagoda/csrc/decoder.cpp field for field.
class _LinearWeight(ctypes.Structure):
    _fields_ = [("weight", cpu_kernels.ops.GemmWeight), ("bias", _PTR)]


class _DecoderLayer(ctypes.Structure):
    _fields_ = [("input_norm", _PTR), ("post_norm", _PTR), ("qkv", _LinearWeight), ("o", _LinearWeight),
                ("gate_up", _LinearWeight), ("down", _LinearWeight), ("k_cache", _PTR), ("v_cache", _PTR),
                ("k_scale", _F32), ("v_scale", _F32)]


class _DecoderStack(ctypes.Structure):
    _fields_ = [("layers", _PTR), ("num_layers", _I64), ("hidden", _I64), ("intermediate", _I64),
                ("num_heads", _I64), ("num_kv_heads", _I64), ("head_dim", _I64), ("block_size", _I64),
                ("cache_kind", _I64), ("rotate_qk", _I64), ("eps", _F32), ("scale", _F32), ("cos", _PTR),
                ("sin", _PTR)]


class _DecodeStep(ctypes.Structure):
    _fields_ = [("num_tokens", _I64), ("num_seqs", _I64), ("max_blocks", _I64), ("window", _I64),
                ("positions", _PTR), ("slots", _PTR), ("block_tables", _PTR), ("seq_lens", _PTR),
                ("query_start_loc", _PTR), ("h", _PTR), ("residual", _PTR), ("qkv", _PTR), ("attn", _PTR),
                ("gate_up", _PTR), ("act", _PTR)]


def native_packed(layer: Linear) -> Any:
    """The layer's packed weight for the native GEMM (bf16, int8 or int4 panels, or int8/int4
    records), or None."""
    if layer.gemm_weight is not None:
        return layer.gemm_weight
    native_weight = getattr(layer.method, "native_weight", None)
    return native_weight() if native_weight is not None else None


def linear_weight(layer: Linear) -> _LinearWeight | None:
    """The layer's packed weight (`native_packed`) and bias; None if it has none."""
    bias = layer.bias
    packed = native_packed(layer)
    if packed is None or (bias is not None and bias.dtype != torch.bfloat16):
        return None
    return _LinearWeight(packed.desc, bias.data_ptr() if bias is not None else None)


ABI_MIRRORS: dict[str, type[ctypes.Structure]] = {
    "LinearWeight": _LinearWeight, "DecoderLayer": _DecoderLayer, "DecoderStack": _DecoderStack,
    "DecodeStep": _DecodeStep}


class NativeDecoder:
    """Runs every decoder layer of a decode step in one native call."""

    def __init__(self, model: LlamaForCausalLM, first: LlamaDecoderLayer, layers: list[_DecoderLayer],
                 cache_kind: int, max_rows: int = 1 << 62) -> None:
        d = model.dims
        self.max_rows = max_rows
        attn = first.self_attn
        self._window = attn.attn.sliding_window or 0
        self._layers = (_DecoderLayer * len(layers))(*layers)
        cos: torch.Tensor = model.rotary.cos  # type: ignore[assignment]
        sin: torch.Tensor = model.rotary.sin  # type: ignore[assignment]
        # NOTE: the struct holds raw pointers: `model` keeps every weight, pool and table alive.
        self._model = model
        self._pool, self._cos = attn.attn.k_cache, cos  # what the indices index (`_check`)
        self._stack = _DecoderStack(ctypes.addressof(self._layers), len(layers), d.hidden_size,
                                    d.intermediate_size, attn.num_heads, attn.num_kv_heads, d.head_dim,
                                    attn.attn.k_cache.shape[1], cache_kind, int(attn.attn.rotates_qk),
                                    d.rms_norm_eps, attn.attn.scale,
                                    cos.data_ptr(), sin.data_ptr())
        self._widths = (attn.qkv_proj.out_features, attn.q_size, 2 * d.intermediate_size, d.intermediate_size)
        self._fn = cpu_kernels.library().fn("decoder_stack_bf16")  # type: ignore[union-attr]

    @classmethod
    def build(cls, model: nn.Module) -> NativeDecoder | None:
        """The native stack for `model`'s weights and bound KV pool, or None where it does not
        fit (models other than the Llama family among them)."""
        lib = cpu_kernels.library()
        if lib is not None:
            lib.check_abi(ABI_MIRRORS)
        if not isinstance(model, LlamaForCausalLM):
            return None
        if lib is None or model.embed_tokens is None or model.norm is None:
            return None
        if model.embed_tokens.tp.size != 1 or model.rotary.cos.dtype != torch.float32:
            return None
        decoder_layers = [layer for layer in model.layers if isinstance(layer, LlamaDecoderLayer)]
        if not decoder_layers or len(decoder_layers) != len(model.layers):
            return None
        if not all(layer.self_attn.attn.supports_native for layer in decoder_layers):
            return None
        if len({layer.self_attn.attn.sliding_window for layer in decoder_layers}) != 1:
            return None  # NOTE: the stack takes one window for every layer
        layers = []
        for layer in decoder_layers:
            native = cls._layer(layer)
            if native is None:
                return None
            layers.append(native)
        cache_kind = CACHE_KINDS.get(decoder_layers[0].self_attn.attn.k_cache.dtype)
        max_rows = min(cls._gemm_rows(layer) for layer in decoder_layers)
        if cache_kind is None or max_rows < 1:
            return None
        return cls(model, decoder_layers[0], layers, cache_kind, max_rows)

    @staticmethod
    def _gemm_rows(layer: LlamaDecoderLayer) -> int:
        """Up to how many rows the layer's kernel plans all take the GEMM (no plan: any), and
        its quantized records the GEMV (`Records.max_rows`)."""
        mlp = layer.mlp
        assert isinstance(mlp, LlamaMLP)  # NOTE: `_layer` took only dense layers
        linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        planned = [m.plan.max_rows("gemm") for m in linears if m.plan is not None]
        records = [getattr(native_packed(m), "max_rows", 1 << 62) for m in linears if m.plan is None]
        return min(planned + records, default=1 << 62)

    @staticmethod
    def _layer(layer: LlamaDecoderLayer) -> _DecoderLayer | None:
        attn = layer.self_attn
        if attn.q_norm is not None or not isinstance(layer.mlp, LlamaMLP):
            return None  # NOTE: the stack computes neither q/k norms nor sparse experts
        weights = [linear_weight(m) for m in (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj,
                                              layer.mlp.down_proj)]
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        k, v = attn.attn.k_cache, attn.attn.v_cache
        if (any(w is None for w in weights) or any(n.dtype != torch.bfloat16 for n in norms)
                or not k.numel() or k.dtype not in CACHE_KINDS):
            return None
        return _DecoderLayer(norms[0].data_ptr(), norms[1].data_ptr(), *weights, k.data_ptr(), v.data_ptr(),
                             attn.attn.k_scale, attn.attn.v_scale)

    def takes(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether the kernel attends every row of this step (its metadata, no torch-path
        prefill chunks), in bf16, with few enough rows that every linear's kernel plan takes
        the GEMM (`max_rows`)."""
        return (isinstance(meta, NativeAttentionMetadata) and meta.num_tokens == h.shape[0] <= self.max_rows
                and h.dtype == torch.bfloat16 and h.is_contiguous() and positions.dtype == torch.int64)

    def __call__(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's MLP output, the residual stream before it), computed in h's buffer."""
        assert isinstance(meta, NativeAttentionMetadata)
        tables, seq_lens, starts = meta.block_tables, meta.seq_lens, meta.query_start_loc
        rows = h.shape[0]
        if checks.ENABLED:
            self._check(positions, meta, rows)
        res = torch.empty_like(h) if residual is None else residual
        qkv, attn, gate_up, act = (torch.empty(rows, w, dtype=h.dtype) for w in self._widths)
        step = _DecodeStep(rows, seq_lens.shape[0], tables.shape[1], self._window, positions.data_ptr(),
                           meta.slot_mapping.data_ptr(), tables.data_ptr(), seq_lens.data_ptr(), starts.data_ptr(),
                           h.data_ptr(), res.data_ptr(), qkv.data_ptr(), attn.data_ptr(), gate_up.data_ptr(),
                           act.data_ptr())
        self._fn(ctypes.byref(self._stack), ctypes.byref(step), int(residual is not None))
        return h, res

    def _check(self, positions: torch.Tensor, meta: NativeAttentionMetadata, rows: int) -> None:
        """The indices the stack's kernels follow, against the pool and rotary tables
        (`PAGODA_CHECK_KERNEL_INPUTS`)."""
        checks.positions(positions, rows, self._cos)
        checks.slots(meta.slot_mapping, rows, self._pool)
        checks.paged(self._pool, meta.block_tables, meta.seq_lens, meta.query_start_loc, rows)
