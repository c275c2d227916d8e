"""Mixture-of-experts feed-forward: top-k routing, then each expert's SwiGLU MLP over its tokens.

`FusedMoE` (vLLM's name) holds every expert's weights stacked per layer: `w13_weight`
[E, 2 * I, H] (gate rows, then up rows) and `w2_weight` [E, H, I] (down). A step's
token-expert pairs are sorted by expert id, so that each expert's rows are contiguous and run
as one product per projection (gate+up merged, then down); the weighted rows are summed back
onto their tokens with one `index_add_`, each token's experts in ascending id order, as
Hugging Face adds them.
Tensor parallelism: rank r holds its slice of every expert's intermediate dimension (gate/up
rows and down columns, as a column- then row-parallel MLP); the partial sums meet in one
all-reduce after the down projection (`ParallelGroup.all_reduce`, the row-parallel layers'
collective).
On CPU, where the kernels compute bf16, bf16 experts run on the small-M GEMM's panels
(`pack_experts_for_cpu`, at engine set-up beside `prepack_for_cpu`), and a bf16 block whose
experts all have native weights (panels, or quantized experts' packed weights) runs router,
routing, experts and weighted sum as one native call (`NativeMoe`, pagoda/csrc/moe.cpp): the
layer path and the native decoder stack alike, so both compute the same bits.
Quantization (`quantization.quantize_model`) gives each expert a packed method per projection
(`expert_methods`, the same `PackedLinearMethod`/`Fp8LinearMethod` objects a `Linear` holds) and
frees the stacked float weights. Checkpoint tensors arrive per expert (`expert_target` maps
their names: Mixtral's `experts.{e}.w1/w3/w2`, Qwen3-MoE's `experts.{e}.gate_proj/up_proj/
down_proj`) and each lands in its expert's slice.
"""

from __future__ import annotations

import ctypes
import itertools
import re
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.distributed.group import SINGLE, ParallelGroup
from pagoda.layers import cpu_kernels
from pagoda.layers.activation import SiluAndMul
from pagoda.layers.cpu_kernels import memory
from pagoda.layers.linear import GEMV_MAX_ROWS, pack_quantized_methods

if TYPE_CHECKING:
    from pagoda.layers.linear import LinearMethod

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


class MoeLayerStruct(ctypes.Structure):
    """pagoda/csrc/moe.h's `MoeLayer`, field for field."""

    _fields_ = [("router", cpu_kernels.ops.GemmWeight), ("w13", _PTR), ("w2", _PTR), ("num_experts", _I64),
                ("top_k", _I64), ("renormalize", _I64), ("weights_in_model_dtype", _I64), ("hidden", _I64),
                ("intermediate", _I64)]


# checkpoint projection name -> (stacked parameter, half of w13: 0 gate, 1 up; 0 for down)
_PROJECTIONS = {"w1": ("w13_weight", 0), "gate_proj": ("w13_weight", 0), "w3": ("w13_weight", 1),
                "up_proj": ("w13_weight", 1), "w2": ("w2_weight", 0), "down_proj": ("w2_weight", 0)}
_EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")


def expert_target(name: str) -> tuple[str, tuple[int, int]] | None:
    """The stacked parameter and (expert, half) shard of a per-expert checkpoint tensor, or None
    for any other name: `layers.0.mlp.experts.3.w3.weight` -> (`layers.0.mlp.experts.w13_weight`,
    (3, 1))."""
    match = _EXPERT_NAME.search(name)
    if match is None:
        return None
    param, half = _PROJECTIONS[match.group(2)]
    return f"{name[:match.start()]}.experts.{param}", (int(match.group(1)), half)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the router's logits (in fp32), then the top k: (weights fp32 [T, k], expert
    ids [T, k]); the k weights renormalized to sum to one when `renormalize` (Mixtral always,
    Qwen3-MoE when `norm_topk_prob`)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, expert_ids


def group_by_expert(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The step's token-expert pairs sorted by expert id (stable: tokens in order within an
    expert): (pair indices into the flattened [T, k], their token rows, rows per expert)."""
    flat = expert_ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, order // expert_ids.shape[1], counts


def _product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T: the bf16 GEMV kernel for a few rows where the kernels run (as `Linear`'s), else torch."""
    if x.shape[0] <= GEMV_MAX_ROWS and weight.dtype == torch.bfloat16 == x.dtype and cpu_kernels.takes(x):
        return cpu_kernels.ops.gemv(x, weight)
    return F.linear(x, weight)


class Router(nn.Module):
    """The router's logits x W^T [T, E], in the model's dtype; the whole weight on every rank.
    NOTE: not a `Linear`, so quantization leaves it as it is (vLLM keeps the gate unquantized
    too: a rounded logit can swap two experts)."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _product(x, self.weight)


class FusedMoE(nn.Module):
    """The experts of one sparse layer: `forward(x, router_logits)` -> the weighted sum of each
    token's top-k experts' outputs (summed over the tensor-parallel group)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, weights_in_model_dtype: bool = False, tp: ParallelGroup = SINGLE) -> None:
        """`weights_in_model_dtype`: the routing weights rounded to the model's dtype before
        they scale an expert's output (Qwen3-MoE), rather than scaling it in fp32 (Mixtral)."""
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.weights_in_model_dtype = weights_in_model_dtype
        self.tp = tp
        self.intermediate_size = intermediate_size
        self.local_size = tp.shard(intermediate_size, "moe intermediate size")[1]
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * self.local_size, hidden_size), requires_grad=False)
        self.w13_weight.weight_loader = self._load_w13  # type: ignore[attr-defined]
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.local_size), requires_grad=False)
        self.w2_weight.weight_loader = self._load_w2  # type: ignore[attr-defined]
        # NOTE: set by quantization: each expert's (gate_up, down) methods, in place of the stacks.
        self.expert_methods: list[tuple[LinearMethod, LinearMethod]] | None = None
        # NOTE: set by `pack_experts_for_cpu`: each expert's bf16 (gate_up, down) GEMM panels, and
        # the whole block (with its router) as one native call where every expert has a native weight.
        self.gemm_weights: list[tuple[cpu_kernels.ops.PackedWeight, cpu_kernels.ops.PackedWeight]] | None = None
        self.native: NativeMoe | None = None
        self.act = SiluAndMul()

    def _local_rows(self, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of a checkpoint tensor's intermediate dimension `dim`."""
        if loaded.shape[dim] != self.intermediate_size:
            raise ValueError(f"expert tensor {tuple(loaded.shape)} has {loaded.shape[dim]} intermediate "
                             f"rows, expected {self.intermediate_size}")
        return loaded.narrow(dim, self.tp.rank * self.local_size, self.local_size)

    def _load_w13(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int, int]) -> None:
        expert, half = shard
        param.data[expert].narrow(0, half * self.local_size, self.local_size).copy_(self._local_rows(loaded, 0))

    def _load_w2(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int, int]) -> None:
        param.data[shard[0]].copy_(self._local_rows(loaded, 1))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = select_experts(router_logits, self.top_k, self.renormalize)
        order, token_ids, counts = group_by_expert(expert_ids, self.num_experts)
        if not x.shape[0]:
            return self.tp.all_reduce(torch.zeros_like(x))
        rows = x[token_ids]
        starts = [0, *itertools.accumulate(counts)]
        out_rows = torch.cat([self._expert(e, rows[starts[e]:starts[e + 1]]) for e in range(self.num_experts)
                              if counts[e]])
        pair_weights = weights.flatten()[order, None]
        if self.weights_in_model_dtype:
            scaled = out_rows * pair_weights.to(x.dtype)
        else:
            scaled = (out_rows * pair_weights).to(x.dtype)
        return self.tp.all_reduce(torch.zeros_like(x).index_add_(0, token_ids, scaled))

    def _expert(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """One expert's SwiGLU MLP over its rows: one product per projection."""
        if self.gemm_weights is not None:
            panels13, panels2 = self.gemm_weights[expert]
            return cpu_kernels.ops.gemm(self.act(cpu_kernels.ops.gemm(rows, panels13)), panels2)
        if self.expert_methods is not None:
            method13, method2 = self.expert_methods[expert]
            return method2.apply(self, self.act(method13.apply(self, rows, None)), None)  # type: ignore[arg-type]
        gate_up = _product(rows, self.w13_weight[expert])
        return _product(self.act(gate_up), self.w2_weight[expert])

    def weight_bytes(self) -> int:
        """Bytes of the quantized experts' packed weights (0 while the stacks hold them)."""
        return sum(m.weight_bytes() for pair in self.expert_methods or () for m in pair)


class NativeMoe:
    """A sparse block (router and experts) as moe.cpp's one call, for bf16 rows of at most
    `max_rows` (what quantized records take); the decoder stack reads `struct`."""

    def __init__(self, router: cpu_kernels.ops.PackedWeight, experts: list[tuple[Any, Any]], moe: FusedMoE,
                 max_rows: int) -> None:
        num = len(experts)
        self._w13 = (cpu_kernels.ops.GemmWeight * num)(*(w13.desc for w13, _ in experts))
        self._w2 = (cpu_kernels.ops.GemmWeight * num)(*(w2.desc for _, w2 in experts))
        self.router = router
        self._experts = experts  # NOTE: the structs point into these and the router
        self.struct = MoeLayerStruct(router.desc, ctypes.addressof(self._w13), ctypes.addressof(self._w2), num,
                                     moe.top_k, int(moe.renormalize), int(moe.weights_in_model_dtype), router.k,
                                     moe.local_size)
        self.max_rows = max_rows
        self._fn = cpu_kernels.library().fn("fused_moe_bf16")  # type: ignore[union-attr]

    def takes(self, x: torch.Tensor) -> bool:
        return (x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_contiguous() and x.device.type == "cpu"
                and 0 < x.shape[0] <= self.max_rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        self._fn(ctypes.byref(self.struct), x.data_ptr(), out.data_ptr(), x.shape[0])
        return out


def _native_experts(moe: FusedMoE) -> tuple[list[tuple[Any, Any]], int] | None:
    """Each expert's native (gate_up, down) weights (bf16 panels, or quantized methods' packed
    weights) and up to how many rows they take, or None where some expert has none."""
    if moe.gemm_weights is not None:
        return list(moe.gemm_weights), 1 << 62
    if moe.expert_methods is None:
        return None
    experts = []
    for pair in moe.expert_methods:
        native = [getattr(m, "native_weight", lambda: None)() for m in pair]
        if any(w is None for w in native):
            return None
        experts.append((native[0], native[1]))
    return experts, min(getattr(w, "max_rows", 1 << 62) for pair in experts for w in pair)


def bind_native_moe(router: Router, moe: FusedMoE) -> bool:
    """Gives `moe` its native call (`NativeMoe`) where it fits: one process, a bf16 router and
    native weights for every expert; returns whether it did."""
    if moe.tp.size != 1 or router.weight.dtype != torch.bfloat16 or router.weight.device.type != "cpu":
        return False
    found = _native_experts(moe)
    if found is None:
        return False
    experts, max_rows = found
    moe.native = NativeMoe(cpu_kernels.ops.PackedWeight(router.weight.detach()), experts, moe, max_rows)
    return True


def _panel_quantized_experts(model: nn.Module) -> None:
    """Quantized experts of a bf16 model onto the GEMM's integer panels where this build
    multiplies them (each method's `use_gemm`, as `prepack_for_cpu` does for a `Linear`), in
    huge pages; the others keep their records."""
    pack_quantized_methods(m for moe in model.modules()
                           if isinstance(moe, FusedMoE) and moe.expert_methods is not None
                           and moe.w13_weight.dtype == torch.bfloat16
                           for pair in moe.expert_methods for m in pair)


def pack_experts_for_cpu(model: nn.Module) -> int:
    """Packs every bf16 `FusedMoE`'s experts onto the small-M GEMM's panels, in one huge-page
    buffer in the order a step reads them, and frees the stacked weights, where the CPU kernels
    compute bf16 (`cpu_kernels.computes_bf16`), and a bf16 model's quantized experts onto the
    integer panels where this build takes them; then gives every block whose experts all have
    native weights its one native call (`bind_native_moe`). Returns the number of bf16 layers packed.

    NOTE: each expert sees a few of a step's rows (rows x k / E on average), where the GEMM is
    the fastest bf16 path measured on both CPUs with kernel plans (docs/performance.md); torch's
    bf16 product without native bf16 (a Zen 3) is ~6x slower at 16 rows."""
    if not (cpu_kernels.available() and cpu_kernels.computes_bf16()):
        return 0
    layers = [m for m in model.modules() if isinstance(m, FusedMoE) and m.w13_weight.dtype == torch.bfloat16
              and m.w13_weight.numel() and m.w13_weight.device.type == "cpu"]
    weights = [w for m in layers for e in range(m.num_experts) for w in (m.w13_weight[e], m.w2_weight[e])]
    if weights:
        views = iter(memory.huge_page_slices([cpu_kernels.ops.packed_bytes(*w.shape) for w in weights]))
        packed = iter([cpu_kernels.ops.PackedWeight(w.detach(), out=next(views)) for w in weights])
        for m in layers:
            m.gemm_weights = [(next(packed), next(packed)) for _ in range(m.num_experts)]
            for w in (m.w13_weight, m.w2_weight):
                w.data = torch.empty(0, dtype=w.dtype)
    _panel_quantized_experts(model)
    for block in model.modules():
        router, experts = getattr(block, "gate", None), getattr(block, "experts", None)
        if isinstance(router, Router) and isinstance(experts, FusedMoE):
            bind_native_moe(router, experts)
    return len(layers)
