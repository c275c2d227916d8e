"""A step's whole stack of decoder layers as one native call (CPU, bf16): the Llama family
(Qwen3's per-head q/k norms too) and Gemma 3 (its q/k norms, Gemma norms around attention and
MLP, GeGLU, each layer's own rotary table and window).

The layer-by-layer path makes ~10 kernel calls a layer through ctypes and nn.Module, ~2 ms
a step for SmolLM2's 30 layers (docs/performance.md): as much as its attention at one stream.
`pagoda_decoder_stack_bf16` (pagoda/csrc/decoder.cpp) runs the same kernels in the same order
on the same buffers, so its output is bit for bit the layer path's (tested).
`NativeDecoder.build` returns None unless the whole model fits: one process (no tensor or
pipeline parallelism), bf16, every linear on the small-M GEMM's packed weights (bf16, int8 or
int4 panels), every mixture-of-experts block with its native call (`NativeMoe`: Mixtral and
Qwen3-MoE run their sparse layers inside the stack), a bf16 or fp8 KV pool bound. It takes steps of at most `max_rows` rows: as far as every linear's kernel plan (kernel_plan.py) names the GEMM. The model runner
builds it when it binds the KV pool; the model calls it in place of its layer loop for steps
the paged-attention kernel attends whole (on the native path every step: decodes and prefill
chunks alike) of at most `max_rows` rows (`takes`), and runs its layers otherwise. A step with
LoRA rows runs it through `adapted`: each adapter's low-rank updates added inside the call.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagoda.layers import cpu_kernels
from pagoda.layers.attention_backend import (
    AttentionMetadata,
    GroupedAttentionMetadata,
    KVCaches,
    LayerKV,
    NativeAttentionMetadata,
)
from pagoda.layers.cpu_kernels import checks
from pagoda.layers.fused_moe import MoeLayerStruct, NativeMoe
from pagoda.layers.linear import Linear
from pagoda.models.gemma3 import Gemma3DecoderLayer, Gemma3ForCausalLM, Gemma3MLP
from pagoda.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

if TYPE_CHECKING:
    from pagoda.lora import LoRAAdapter, LoRARequest

_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
CACHE_KINDS = {torch.bfloat16: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
ARCH_LLAMA, ARCH_GEMMA3 = 0, 1  # decoder.cpp's Arch


# NOTE: these mirror the structs of pagoda/csrc/decoder.cpp field for field.
class _LinearWeight(ctypes.Structure):
    _fields_ = [("weight", cpu_kernels.ops.GemmWeight), ("bias", _PTR), ("perm", _PTR)]


class _DecoderLayer(ctypes.Structure):
    _fields_ = [("input_norm", _PTR), ("post_norm", _PTR), ("qkv", _LinearWeight), ("o", _LinearWeight),
                ("gate_up", _LinearWeight), ("down", _LinearWeight), ("k_cache", _PTR), ("v_cache", _PTR),
                ("k_scale", _F32), ("v_scale", _F32), ("cos", _PTR), ("sin", _PTR), ("window", _I64),
                ("group", _I64), ("q_norm", _PTR), ("k_norm", _PTR), ("pre_ff_norm", _PTR), ("post_ff_norm", _PTR),
                ("moe", _PTR)]


class _DecoderStack(ctypes.Structure):
    _fields_ = [("layers", _PTR), ("num_layers", _I64), ("hidden", _I64), ("intermediate", _I64),
                ("num_heads", _I64), ("num_kv_heads", _I64), ("head_dim", _I64), ("block_size", _I64),
                ("cache_kind", _I64), ("rotate_qk", _I64), ("arch", _I64), ("eps", _F32), ("scale", _F32)]


class _StepGroup(ctypes.Structure):
    _fields_ = [("slots", _PTR), ("block_tables", _PTR), ("max_blocks", _I64)]


class _DecodeStep(ctypes.Structure):
    _fields_ = [("num_tokens", _I64), ("num_seqs", _I64), ("groups", _PTR), ("positions", _PTR), ("seq_lens", _PTR),
                ("query_start_loc", _PTR), ("h", _PTR), ("residual", _PTR), ("qkv", _PTR), ("attn", _PTR),
                ("gate_up", _PTR), ("act", _PTR), ("lora_runs", _PTR), ("num_lora_runs", _I64)]


class _LoraUpdate(ctypes.Structure):
    _fields_ = [("a", _PTR), ("b_t", _PTR), ("cols", _PTR), ("r", _I64), ("start", _I64), ("width", _I64)]


class _LoraRun(ctypes.Structure):
    _fields_ = [("rows", _PTR), ("count", _I64), ("updates", _PTR)]


def native_packed(layer: Linear) -> Any:
    """The layer's packed weight for the native GEMM (bf16, int8 or int4 panels, or int8/int4
    records), or None."""
    native_weight = getattr(layer.method, "native_weight", None)
    return native_weight() if native_weight is not None else None


def linear_weight(layer: Linear) -> _LinearWeight | None:
    """The layer's packed weight (`native_packed`), bias and input permutation (GPTQ act
    order); None if it has no packed weight."""
    bias = layer.bias
    packed = native_packed(layer)
    if packed is None or (bias is not None and bias.dtype != torch.bfloat16):
        return None
    perm = getattr(layer.method, "perm", None)
    return _LinearWeight(packed.desc, bias.data_ptr() if bias is not None else None,
                         perm.data_ptr() if perm is not None else None)


ABI_MIRRORS: dict[str, type[ctypes.Structure]] = {
    "LinearWeight": _LinearWeight, "DecoderLayer": _DecoderLayer, "DecoderStack": _DecoderStack,
    "DecodeStep": _DecodeStep, "StepGroup": _StepGroup, "LoraUpdate": _LoraUpdate, "LoraRun": _LoraRun,
    "MoeLayer": MoeLayerStruct}


DecoderLayer = LlamaDecoderLayer | Gemma3DecoderLayer


class NativeDecoder:
    """Runs every decoder layer of a decode step in one native call."""

    def __init__(self, model: LlamaForCausalLM | Gemma3ForCausalLM, caches: KVCaches, first: DecoderLayer,
                 layers: list[_DecoderLayer], cache_kind: int, max_rows: int = 1 << 62) -> None:
        d = model.dims
        self.max_rows = max_rows
        attn = first.self_attn
        self._layers = (_DecoderLayer * len(layers))(*layers)
        # NOTE: the struct holds raw pointers: `model` keeps every weight and table alive, and
        # `caches` (the runner's) every pool (Gemma's norm scales live in their modules, remade
        # only if a weight changes).
        self._model, self._caches = model, caches
        arch = ARCH_GEMMA3 if isinstance(model, Gemma3ForCausalLM) else ARCH_LLAMA
        # NOTE: what the indices index (`_check`): each group's pool, the rotary tables
        self._pools = {caches[a].group: caches[a].k for a in model.attention_layers()}
        self._tables = _rotary_tables(model)
        pool = caches[attn.attn].k
        self._stack = _DecoderStack(ctypes.addressof(self._layers), len(layers), d.hidden_size,
                                    d.intermediate_size, attn.num_heads, attn.num_kv_heads, d.head_dim,
                                    pool.shape[1], cache_kind, int(attn.attn.rotates_qk(pool)), arch,
                                    d.rms_norm_eps, attn.attn.scale)
        self._widths = (attn.qkv_proj.out_features, attn.q_size, 2 * d.intermediate_size, d.intermediate_size)
        self._num_groups = max(layer.group for layer in layers) + 1
        self._fn = cpu_kernels.library().fn("decoder_stack_bf16")  # type: ignore[union-attr]
        names = {id(m): name for name, m in model.named_modules()}
        # NOTE: each layer's qkv, o, gate_up and down by module name: what an adapter's updates name
        # (a sparse layer's two feed-forward entries name nothing: adapters adapt no experts)
        self._projections = [names[id(m)] if m is not None else "" for layer in model.layers
                             for m in _linears(layer)]  # type: ignore[arg-type]

    @classmethod
    def build(cls, model: nn.Module, caches: KVCaches) -> NativeDecoder | None:
        """The native stack for `model`'s weights over the runner's KV pools `caches`, or None
        where it does not fit (`make` says why)."""
        made = cls.make(model, caches)
        return made if isinstance(made, NativeDecoder) else None

    @classmethod
    def make(cls, model: nn.Module, caches: KVCaches) -> NativeDecoder | str:
        """The native stack for `model`'s weights over the runner's KV pools `caches`, or why it
        does not fit (models other than the Llama family and Gemma 3 among them)."""
        lib = cpu_kernels.library()
        if lib is not None:
            lib.check_abi(ABI_MIRRORS)
        if not isinstance(model, LlamaForCausalLM | Gemma3ForCausalLM):
            return f"{type(model).__name__} is not of the Llama family or Gemma 3"
        if lib is None:
            return "no CPU kernels"
        if model.embed_tokens is None or model.norm is None:
            return "a pipeline stage without the first or last layers"
        tables = _rotary_tables(model)
        if model.embed_tokens.tp.size != 1:
            return "tensor parallelism"
        if any(t.dtype != torch.float32 for t in tables):
            return "rotary tables not in fp32"
        decoder_layers = [layer for layer in model.layers if isinstance(layer, LlamaDecoderLayer | Gemma3DecoderLayer)]
        if not decoder_layers or len(decoder_layers) != len(model.layers):
            return "decoder layers of another kind"
        if not all(layer.self_attn.attn.supports_native for layer in decoder_layers):
            return "attention the kernel does not take"
        layers = []
        for i, layer in enumerate(decoder_layers):
            native = cls._layer(model, layer, caches[layer.self_attn.attn])
            if isinstance(native, str):
                return f"layer {i}: {native}"
            layers.append(native)
        pool_dtype = caches[decoder_layers[0].self_attn.attn].k.dtype
        cache_kind = CACHE_KINDS.get(pool_dtype)
        max_rows = min(cls._gemm_rows(layer) for layer in decoder_layers)
        if cache_kind is None:
            return f"a {pool_dtype} KV cache"
        if max_rows < 1:
            return "a linear whose kernel plan never takes the GEMM"
        return cls(model, caches, decoder_layers[0], layers, cache_kind, max_rows)

    @staticmethod
    def _gemm_rows(layer: DecoderLayer) -> int:
        """Up to how many rows the layer's kernel plans all take the GEMM (no plan: any), and
        its quantized records the GEMV (`Records.max_rows`)."""
        linears = [m for m in _linears(layer) if m is not None]
        plans = [getattr(m.method, "plan", None) for m in linears]
        planned = [p.max_rows("gemm") for p in plans if p is not None]
        records = [getattr(native_packed(m), "max_rows", 1 << 62) for m, p in zip(linears, plans, strict=True) if p is None]
        moe = _native_moe(layer)
        return min(planned + records + ([moe.max_rows] if moe is not None else []), default=1 << 62)

    @staticmethod
    def _layer(model: LlamaForCausalLM | Gemma3ForCausalLM, layer: DecoderLayer,
               kv: LayerKV) -> _DecoderLayer | str:
        """The layer's native struct over its pools `kv`, or why it has none."""
        kind = _gemma3_kind(model, layer) if isinstance(layer, Gemma3DecoderLayer) else _llama_kind(model, layer)
        if isinstance(kind, str):
            return kind
        norms, rotary = kind
        attn = layer.self_attn.attn
        linears = _linears(layer)
        weights = [linear_weight(m) if m is not None else _LinearWeight() for m in linears]
        k, v = kv.k, kv.v
        for name, m, w in zip(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), linears, weights, strict=True):
            if w is None and m is not None:
                return f"{name} has no native weight ({getattr(m.method, 'name', type(m.method).__name__)})"
        if not k.numel() or k.dtype not in CACHE_KINDS:
            return "no KV pool the kernel reads"
        pointers = [n.data_ptr() for n in norms] + [None] * (6 - len(norms))
        cos: torch.Tensor = rotary.cos  # type: ignore[assignment]
        sin: torch.Tensor = rotary.sin  # type: ignore[assignment]
        return _DecoderLayer(pointers[0], pointers[1], *weights, k.data_ptr(), v.data_ptr(), attn.k_scale,
                             attn.v_scale, cos.data_ptr(), sin.data_ptr(), attn.sliding_window or 0,
                             kv.group, *pointers[2:], _moe_pointer(layer))

    def adapted(self, rows: list[tuple[LoRARequest, int, int]],
                adapter_of: Callable[[LoRARequest], LoRAAdapter]) -> AdaptedStack | None:
        """The stack for a step whose `rows` ((adapter, first row, row count)) run with LoRA
        adapters, each row adding its adapter's updates inside the call; None if an adapter
        adapts a projection the stack does not run."""
        by_adapter: dict[int, tuple[LoRARequest, list[int]]] = {}
        for request, first, count in rows:
            by_adapter.setdefault(request.lora_int_id, (request, []))[1].extend(range(first, first + count))
        runs, indices = [], []
        for request, row_ids in by_adapter.values():
            updates = self._updates(adapter_of(request))
            if updates is None:
                return None
            indices.append(torch.tensor(row_ids, dtype=torch.int64))
            runs.append(_LoraRun(indices[-1].data_ptr(), len(row_ids), ctypes.addressof(updates)))
        return AdaptedStack(self, (_LoraRun * len(runs))(*runs), indices)

    def _updates(self, adapter: LoRAAdapter) -> Any:
        """The adapter's updates as the stack reads them (4 a layer), made once an adapter and
        kept on it (`LoRAAdapter.native`)."""
        if adapter.native is not None:
            return adapter.native[0]
        if not set(adapter.updates) <= set(self._projections):
            return None
        structs, kept = [], []
        for name in self._projections:
            u = adapter.updates.get(name)
            if u is None:
                structs.append(_LoraUpdate())
                continue
            a, spans = u.a_t.T.contiguous(), _nonzero_spans(u.b_t)  # NOTE: a's rows are the dot products' operands
            kept += [a, spans]
            structs.append(_LoraUpdate(a.data_ptr(), u.b_t.data_ptr(), spans.data_ptr(), u.a_t.shape[1], u.start,
                                       u.b_t.shape[1]))
        updates = (_LoraUpdate * len(structs))(*structs)  # NOTE: the adapter keeps b_t alive, `kept` the rest
        adapter.native = (updates, kept)
        return updates

    def takes(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether the kernel attends every row of this step (its metadata, every KV cache
        group's, no torch-path prefill chunks), in bf16, with few enough rows that every
        linear's kernel plan takes the GEMM (`max_rows`)."""
        groups = _groups(meta)
        return (groups is not None and len(groups) >= self._num_groups
                and groups[0].num_tokens == h.shape[0] <= self.max_rows
                and h.dtype == torch.bfloat16 and h.is_contiguous() and positions.dtype == torch.int64)

    def __call__(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                 meta: AttentionMetadata, lora_runs: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's MLP output, the residual stream before it), computed in h's buffer;
        `lora_runs`: the adapted rows (`adapted`)."""
        groups = _groups(meta)
        assert groups is not None
        seq_lens, starts = groups[0].seq_lens, groups[0].query_start_loc
        rows = h.shape[0]
        if checks.ENABLED:
            self._check(positions, groups, rows)
        res = torch.empty_like(h) if residual is None else residual
        qkv, attn, gate_up, act = (torch.empty(rows, w, dtype=h.dtype) for w in self._widths)
        views = (_StepGroup * len(groups))(*(
            _StepGroup(g.slot_mapping.data_ptr(), g.block_tables.data_ptr(), g.block_tables.shape[1])
            for g in groups))
        step = _DecodeStep(rows, seq_lens.shape[0], ctypes.addressof(views), positions.data_ptr(),
                           seq_lens.data_ptr(), starts.data_ptr(), h.data_ptr(), res.data_ptr(), qkv.data_ptr(),
                           attn.data_ptr(), gate_up.data_ptr(), act.data_ptr(),
                           ctypes.addressof(lora_runs) if lora_runs is not None else None,
                           len(lora_runs) if lora_runs is not None else 0)
        self._fn(ctypes.byref(self._stack), ctypes.byref(step), int(residual is not None))
        return h, res

    def _check(self, positions: torch.Tensor, groups: list[NativeAttentionMetadata], rows: int) -> None:
        """The indices the stack's kernels follow, against the pools and rotary tables
        (`PAGODA_CHECK_KERNEL_INPUTS`)."""
        for table in self._tables:
            checks.positions(positions, rows, table)
        for group, pool in self._pools.items():  # NOTE: once a group: its layers' pools share a shape
            g = groups[group]
            checks.slots(g.slot_mapping, rows, pool)
            checks.paged(pool, g.block_tables, g.seq_lens, g.query_start_loc, rows)


def _nonzero_spans(b_t: torch.Tensor) -> torch.Tensor:
    """Each row's nonzero columns of `b_t` as [begin, end) (int64 [r, 2]; [0, 0) for a zero row):
    a fused projection's b_t is block-diagonal, each part's rows zero outside its columns."""
    nonzero = b_t != 0
    width = b_t.shape[1]
    begin = torch.where(nonzero.any(1), nonzero.int().argmax(1), 0)
    end = torch.where(nonzero.any(1), width - nonzero.flip(1).int().argmax(1), 0)
    return torch.stack((begin, end), 1).to(torch.int64).contiguous()


class AdaptedStack:
    """The native stack for one step with adapted rows (`NativeDecoder.adapted`)."""

    def __init__(self, decoder: NativeDecoder, runs: Any, rows: list[torch.Tensor]) -> None:
        self.decoder, self.runs, self._rows = decoder, runs, rows  # NOTE: the runs point into rows

    def takes(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> bool:
        return self.decoder.takes(h, positions, meta)

    def __call__(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        return self.decoder(h, residual, positions, meta, self.runs)


def _groups(meta: AttentionMetadata) -> list[NativeAttentionMetadata] | None:
    """The step's native metadata per KV cache group (one without a hybrid cache), or None
    where some group runs the torch path."""
    groups = meta.groups if isinstance(meta, GroupedAttentionMetadata) else [meta]
    native = [g for g in groups if isinstance(g, NativeAttentionMetadata)]
    return native if len(native) == len(groups) else None


def _llama_kind(model: nn.Module, layer: LlamaDecoderLayer) -> tuple[list[torch.Tensor], nn.Module] | str:
    """A Llama-family layer's norm weights (input, post-attention, and Qwen3's per-head q and k)
    and rotary, or why the stack does not compute it (sparse experts without their native call,
    non-bf16 norms)."""
    if not isinstance(layer.mlp, LlamaMLP) and _native_moe(layer) is None:
        return (f"a {type(layer.mlp).__name__} feed-forward (the stack's is a dense MLP, or experts with "
                "native weights in bf16)")
    attn = layer.self_attn
    norms: list[torch.Tensor] = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    if attn.q_norm is not None and attn.k_norm is not None:
        norms += [attn.q_norm.weight, attn.k_norm.weight]
    rotary: nn.Module = model.rotary  # type: ignore[assignment]
    dtypes = {n.dtype for n in norms}
    return (norms, rotary) if dtypes == {torch.bfloat16} else f"{dtypes.pop()} norms (the stack's are bf16)"


def _gemma3_kind(model: nn.Module, layer: Gemma3DecoderLayer) -> tuple[list[torch.Tensor], nn.Module] | str:
    """A Gemma 3 layer's norm scales (input, post-attention, q, k, pre- and post-feed-forward)
    and its kind's rotary, or why not: a GELU other than tanh's (the stack's GeGLU)."""
    attn = layer.self_attn
    if layer.mlp.act.approximate != "tanh":
        return f"GELU ({layer.mlp.act.approximate}; the stack's is tanh's)"
    norms = [m.scale() for m in (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm,
                                 layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm)]
    rotary: nn.Module = model.rotary[layer.layer_type]  # type: ignore[index,assignment]
    return norms, rotary


def _linears(layer: DecoderLayer) -> tuple[Linear | None, ...]:
    """qkv, o, gate_up and down (None, None for a sparse block's: `_native_moe`)."""
    mlp = layer.mlp
    if not isinstance(mlp, LlamaMLP | Gemma3MLP):
        return layer.self_attn.qkv_proj, layer.self_attn.o_proj, None, None
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _native_moe(layer: DecoderLayer) -> NativeMoe | None:
    """A sparse layer's native call (`FusedMoE.native`), or None (a dense layer, or experts without it)."""
    native = getattr(getattr(layer.mlp, "experts", None), "native", None)
    return native if isinstance(native, NativeMoe) else None


def _moe_pointer(layer: DecoderLayer) -> int | None:
    moe = _native_moe(layer)
    return ctypes.addressof(moe.struct) if moe is not None else None


def _rotary_tables(model: LlamaForCausalLM | Gemma3ForCausalLM) -> list[torch.Tensor]:
    """Every rotary cos table of the model (Gemma 3: one per layer kind)."""
    rotaries = model.rotary.values() if isinstance(model.rotary, nn.ModuleDict) else [model.rotary]
    return [r.cos for r in rotaries]  # type: ignore[misc]
