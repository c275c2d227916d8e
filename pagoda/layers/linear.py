"""Linear layers whose parameters carry their own `weight_loader`.

Fused projections (q/k/v, gate/up) are one GEMM each; the checkpoint's separate tensors are
copied into their slice by shard index, so the loader stays a dictionary lookup.
On CPU with the native kernels, `prepack_for_cpu(model, plan=...)` gives each bf16 layer one
`UnquantizedLinearMethod` holding its shape's kernel plan (kernel_plan.py: which of the GEMV on
the plain weight, the small-M GEMM on packed panels, oneDNN's prepacked copy or F.linear runs
each row count, chosen by measurement) and just the storages those paths read. All compute fp32
sums of exact bf16 products, rounded once, so they differ only in summation order.
Without a plan (`prepack_for_cpu(model)`: kernels off, other devices) the fixed rules hold:
the GEMM's panels where the `avx512bf16` build loads, else oneDNN's copy plus the plain weight
for GEMV steps of at most `GEMV_MAX_ROWS` rows; int8 (per channel) and int4 quantized layers
are repacked for the GEMM's quantized variants on the `avx512bf16` build.
How the weight is stored and applied is the layer's linear method (`method`), its one piece of
execution state, set once after loading (`weight_processing.process_weights_after_loading`, vLLM's
name, the one place that runs the quantizers and `prepack_for_cpu`, in that order): unquantized
(the paths above) by default; `pagoda.layers.quantization` swaps in packed int8/int4 or fp8
methods after loading, or prepares GGUF-packed ones before it, without changing the layer's
interface (`weight_loader`, `forward`, `project`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar, Protocol, TypeGuard

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.layers import cpu_kernels
from pagoda.layers.cpu_kernels import memory
from pagoda.layers.kernel_plan import KernelPlan, ShapePlan

# NOTE: measured (docs/performance.md, Kernels), one thread each, SmolLM2's 30 layers of distinct
# weights: the GEMV kernel streams them 1.4-1.6x faster than oneDNN's prepacked bf16 path at 1
# row, 1.4-1.8x at 2, 0.9x at 3-4.
GEMV_MAX_ROWS = 2


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not match parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


class LinearMethod(Protocol):
    """How a `Linear` stores its weight and computes x W^T + bias."""

    @property
    def name(self) -> str: ...

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...

    def weight_bytes(self) -> int: ...


@dataclass(frozen=True, eq=False)
class UnquantizedLinearMethod:
    """The float weight (the layer's parameter), by the path the kernel plan names for the
    step's row count (kernel_plan.py), with the storages its paths read besides the plain
    weight: the GEMM's panels (`gemm_weight`) and oneDNN's prepacked copy (`packed`). Without a
    plan (no CPU kernels, other devices): the GEMM's panels, the bf16 GEMV kernel for small
    native steps, oneDNN's copy, or F.linear."""

    plan: ShapePlan | None = None
    gemm_weight: cpu_kernels.ops.PackedWeight | None = None
    packed: torch.Tensor | None = None
    name: ClassVar[str] = "unquantized"

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.plan is not None:
            return PATH_FNS[self.plan.path_for(x.shape[0])](layer.weight, self, x, bias)
        if self.gemm_weight is not None:
            return cpu_kernels.ops.gemm(x, self.gemm_weight, bias)
        if x.shape[0] <= GEMV_MAX_ROWS and layer._gemv_ready() and cpu_kernels.takes(x):
            return cpu_kernels.ops.gemv(x, layer.weight, bias)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        return F.linear(x, layer.weight, bias)

    def native_weight(self) -> cpu_kernels.ops.PackedWeight | None:
        """The GEMM's panels, which the native decoder stack reads (None: not packed)."""
        return self.gemm_weight

    def weight_bytes(self) -> int:
        return 0  # NOTE: the layer's parameters hold it


def _gemv(weight: torch.Tensor, method: UnquantizedLinearMethod, x: torch.Tensor,
          bias: torch.Tensor | None) -> torch.Tensor:
    return cpu_kernels.ops.gemv(x, weight, bias)


def _gemm(weight: torch.Tensor, method: UnquantizedLinearMethod, x: torch.Tensor,
          bias: torch.Tensor | None) -> torch.Tensor:
    assert method.gemm_weight is not None
    return cpu_kernels.ops.gemm(x, method.gemm_weight, bias)


def _onednn(weight: torch.Tensor, method: UnquantizedLinearMethod, x: torch.Tensor,
            bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, method.packed, bias, "none", [], "")


def _torch(weight: torch.Tensor, method: UnquantizedLinearMethod, x: torch.Tensor,
           bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


# The kernel_plan paths, each reading the storage of that name (kernel_plan.STORAGE): the plain
# weight, or the method's.
PATH_FNS = {"gemv": _gemv, "gemm": _gemm, "onednn": _onednn, "torch": _torch}

UNQUANTIZED = UnquantizedLinearMethod()  # NOTE: the default, before any storage is made


def is_unquantized(layer: Linear) -> bool:
    """Whether the layer holds a float weight (packed for the CPU kernels or not)."""
    return isinstance(layer.method, UnquantizedLinearMethod)


class Linear(nn.Module):
    """y = x W^T (+ b)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = default_weight_loader  # type: ignore[attr-defined]

        self.in_features, self.out_features = input_size, output_size
        self.method: LinearMethod = UNQUANTIZED

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.bias)

    def project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T + bias, by the fastest path this weight has."""
        return self.method.apply(self, x, bias)

    def _gemv_ready(self) -> bool:
        w = self.weight
        return w.dtype == torch.bfloat16 and w.numel() > 0 and w.device.type == "cpu"


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dimension."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = output_sizes
        self.weight.weight_loader = self._shard_loader  # type: ignore[attr-defined]
        if self.bias is not None:
            self.bias.weight_loader = self._shard_loader  # type: ignore[attr-defined]
        self.fuse_checkpoint_parts(output_sizes)

    def fuse_checkpoint_parts(self, sizes: list[int]) -> None:
        """The parts' sizes in a checkpoint that stores them already fused (Phi-3's qkv_proj
        and gate_up_proj): `load_weights` splits such a tensor and loads each part."""
        for param in (self.weight, self.bias):
            if param is not None:
                param.fused_sizes = sizes  # type: ignore[attr-defined]

    def _shard_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        start = sum(self.output_sizes[:shard])
        size = self.output_sizes[shard]
        if loaded.shape[0] != size:
            raise ValueError(f"shard {shard} has {loaded.shape[0]} rows, expected {size}")
        param.data.narrow(0, start, size).copy_(loaded)


def prepack_for_cpu(model: nn.Module, keep: set[int] = frozenset(),  # type: ignore[assignment]
                    plan: KernelPlan | None = None) -> int:
    """Packs every bf16 CPU `Linear` for its fastest kernel; frees the plain weights not in `keep` (ids).

    With the native GEMM (`cpu_kernels.ops.gemm_is_native()`) each weight is packed for it, and
    that packed copy is the only one kept; so are quantized weights whose format this build's GEMM
    takes (the method's `use_gemm`: int8 per channel and int4 on the avx512bf16 and avx2 builds).
    Otherwise, on CPUs where oneDNN has native bf16, each weight is prepacked for oneDNN; where
    the (portable) kernels are available the plain weights stay too, for the GEMV kernel's small
    steps, at the cost of a second copy. The GEMM's packed weights live in huge pages, in module
    order: the bf16 ones packed straight into one buffer, the quantized panels gathered into
    another (`cpu_kernels.memory`).
    With a kernel `plan` (kernel_plan.py), each bf16 weight whose shape it covers is given the
    storages its paths read instead, and the plain weight is freed where none reads it.
    Returns the number of layers packed.
    """
    native_gemm = cpu_kernels.available() and cpu_kernels.ops.gemm_is_native()
    if plan is not None:
        return _apply_plan(model, plan, keep) + _pack_quantized(model)
    if not native_gemm and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return _pack_quantized(model)
    keep_all = cpu_kernels.available() and not native_gemm
    dense = [m for m in model.modules() if is_dense_bf16(m)]
    panels = _pack_in_huge_pages(dense) if native_gemm else [None] * len(dense)
    for module, gemm_weight in zip(dense, panels, strict=True):
        w = module.weight
        packed = None if native_gemm else torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1)
        module.method = UnquantizedLinearMethod(gemm_weight=gemm_weight, packed=packed)
        if id(w) not in keep and not keep_all:
            w.data = torch.empty(0, dtype=w.dtype)
    return len(dense) + _pack_quantized(model)


def weight_shape(module: Linear) -> tuple[int, int]:
    """(out, in) of the layer's weight as stored here (a shard's, under tensor parallelism)."""
    return int(module.weight.shape[0]), int(module.weight.shape[1])


def is_dense_bf16(module: nn.Module) -> TypeGuard[Linear]:
    """Whether `module` is a `Linear` with an unquantized bf16 CPU weight (what plans cover)."""
    w = getattr(module, "weight", None)
    return (isinstance(module, Linear) and is_unquantized(module) and w is not None and bool(w.numel())
            and w.dtype == torch.bfloat16 and w.device.type == "cpu")


def _apply_plan(model: nn.Module, plan: KernelPlan, keep: set[int]) -> int:
    planned: list[tuple[Linear, ShapePlan]] = []
    for module in model.modules():
        if is_dense_bf16(module):
            shape_plan = plan.for_shape(weight_shape(module))
            if shape_plan is not None:
                planned.append((module, shape_plan))
    with_panels = [m for m, p in planned if "panels" in p.storages]
    panels = dict(zip(map(id, with_panels), _pack_in_huge_pages(with_panels), strict=True))
    for module, shape_plan in planned:
        w = module.weight
        packed = (torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1)
                  if "onednn" in shape_plan.storages else None)
        module.method = UnquantizedLinearMethod(shape_plan, panels.get(id(module)), packed)
        if "plain" not in shape_plan.storages and id(w) not in keep:
            w.data = torch.empty(0, dtype=w.dtype)
    return len(planned)


def _pack_quantized(model: nn.Module) -> int:
    """Gathers the quantized weights that this build's GEMM takes (the method's `use_gemm`) in huge pages."""
    if not cpu_kernels.available():
        return 0
    methods = [m.method for m in model.modules()
               if isinstance(m, Linear) and getattr(m, "weight", None) is not None and m.weight.dtype == torch.bfloat16]
    return pack_quantized_methods(methods)


def pack_quantized_methods(methods: Iterable[object]) -> int:
    """Repacks each quantized method whose format this build's GEMM takes (its `use_gemm`) onto
    the GEMM's panels, gathered in huge pages; returns how many (bf16 activations: the caller's check)."""
    panels = []
    for method in methods:
        use_gemm = getattr(method, "use_gemm", None)
        if use_gemm is not None and use_gemm():
            panels.append(getattr(method, "panels"))  # noqa: B009 - set by use_gemm()
    if panels:
        cpu_kernels.ops.gather_in_huge_pages(panels)
    return len(panels)


def _pack_in_huge_pages(modules: list[Linear]) -> list[cpu_kernels.ops.PackedWeight]:
    """Each module's bf16 weight packed for the GEMM straight into one huge-page buffer, in module
    order: the order a step reads them.

    NOTE: packed in place, not packed then gathered: a few hundred MB freed in the heap's middle
    were not always given back to the system (resident memory 733 MB against 663)."""
    if not modules:
        return []
    views = memory.huge_page_slices([cpu_kernels.ops.packed_bytes(*m.weight.shape) for m in modules])
    return [cpu_kernels.ops.PackedWeight(module.weight.detach(), out=view)
            for module, view in zip(modules, views, strict=True)]
