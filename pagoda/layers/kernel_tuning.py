"""Measuring the linear paths on a model's own weights: the timings `kernel_plan.decide` reads.

`plan_for_model` groups the model's bf16 linears by shape, and for each shape times every path
this machine has (kernel_plan.PATHS) over that shape's own weights, one layer after another as a
step reads them, at each row bucket. Enough distinct layers are used that their weights do not
fit the CPU's caches (`STREAM_BYTES`), so small-row timings see the memory stream a step sees.
The other storages (packed panels, oneDNN's blocked copy) exist only while their shape is timed.
The plan is cached (kernel_plan.store) and reused while nothing it depends on changes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from pagoda.layers import cpu_kernels, kernel_plan
from pagoda.layers.kernel_plan import BUCKETS, KernelPlan, Shape, ShapePlan
from pagoda.layers.linear import (
    PATH_FNS,
    Linear,
    UnquantizedLinearMethod,
    is_dense_bf16,
    weight_shape,
)

logger = logging.getLogger("pagoda")

# NOTE: more than the last-level cache of the machines seen (32 MB on 2-vCPU Zen 3/4 slices,
# less on the Xeon), so a pass at one row streams from memory as a decode step does.
STREAM_BYTES = 96 << 20


def available_paths() -> list[str]:
    """The paths this process can run, in kernel_plan.PATHS order."""
    paths = ["gemv", "gemm"] if cpu_kernels.available() else []
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        paths.append("onednn")
    return [*paths, "torch"]


def plannable_linears(model: nn.Module) -> dict[Shape, list[Linear]]:
    """The model's bf16 CPU linears with unquantized weights, by (out_features, in_features)."""
    groups: dict[Shape, list[Linear]] = {}
    for module in model.modules():
        if is_dense_bf16(module):
            groups.setdefault(weight_shape(module), []).append(module)
    return groups


class _ShapeTimer:
    """One pass of a path over the first layers of a shape (each in every storage needed)."""

    def __init__(self, layers: list[Linear], paths: Sequence[str], threads_for_rows: Callable[[int], int]) -> None:
        n, k = layers[0].weight.shape
        self.bytes = 2 * n * k
        count = max(1, min(len(layers), -(-STREAM_BYTES // self.bytes)))
        self.layers = [_Stand(layer, paths) for layer in layers[:count]]
        self.k = k
        self.threads_for_rows = threads_for_rows
        self._x: dict[int, torch.Tensor] = {}

    def __call__(self, path: str, rows: int) -> float:
        """Seconds per layer of one pass over `layers_for(rows)` layers."""
        x = self._x.get(rows)
        if x is None:
            x = self._x[rows] = (torch.randn(rows, self.k) * 0.5).to(torch.bfloat16)
        fn, layers = PATH_FNS[path], self.layers[:self.layers_for(rows)]
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads_for_rows(rows))
        try:
            start = time.perf_counter()
            for stand in layers:
                fn(stand.weight, stand.method, x, stand.bias)
            return (time.perf_counter() - start) / len(layers)
        finally:
            torch.set_num_threads(before)

    def layers_for(self, rows: int) -> int:
        """All the streamed layers up to 8 rows; fewer as rows grow (the products become
        bound by arithmetic, not by the stream), so that a bucket's pass stays short."""
        return max(1, min(len(self.layers), -(-STREAM_BYTES * 8 // (self.bytes * max(rows, 8)))))


class _Stand:
    """A layer's weight in every storage the timed paths read (the method PATH_FNS are given)."""

    def __init__(self, layer: Linear, paths: Sequence[str]) -> None:
        self.weight = layer.weight.detach()
        self.bias = layer.bias
        self.method = UnquantizedLinearMethod(
            gemm_weight=cpu_kernels.ops.PackedWeight(self.weight) if "gemm" in paths else None,
            packed=torch.ops.mkldnn._reorder_linear_weight(self.weight, 1) if "onednn" in paths else None)


def plan_for_model(model: nn.Module, build: str, threads_for_rows: Callable[[int], int],
                   retune: bool = False) -> KernelPlan | None:
    """The kernel plan for `model`'s bf16 linears: forced (PAGODA_LINEAR_PLAN), cached, or measured
    now (and cached); None when the model has no such linear."""
    groups = plannable_linears(model)
    if not groups:
        return None
    paths = available_paths()
    forced = os.environ.get(kernel_plan.PLAN_ENV)
    if forced:
        shape_plan = kernel_plan.parse_forced(forced, paths)
        return KernelPlan({shape: shape_plan for shape in groups}, "forced")
    copies = kernel_plan.copies_from_env()
    key = kernel_plan.plan_key(((s, len(layers)) for s, layers in groups.items()), build,
                               torch.get_num_threads(), copies)
    cached = None if retune else kernel_plan.load_cached(key)
    if cached is not None and set(cached.shapes) == set(groups) and _runs_here(cached, paths):
        return cached
    start = time.perf_counter()
    shapes: dict[Shape, ShapePlan] = {}
    timings = {}
    for shape, layers in groups.items():
        timings[shape] = kernel_plan.measure(_ShapeTimer(layers, paths, threads_for_rows), paths)
        shapes[shape] = kernel_plan.decide(timings[shape], copies)
    plan = KernelPlan(shapes, "measured", key, timings)
    where = kernel_plan.store(plan)
    logger.info("Measured the linear kernels (%s) in %.1f s%s", ", ".join(paths), time.perf_counter() - start,
                f"; cached in {where}" if where else "")
    return plan


def _runs_here(plan: KernelPlan, paths: Sequence[str]) -> bool:
    return all(set(p.paths) <= set(paths) for p in plan.shapes.values())


__all__ = ["BUCKETS", "available_paths", "plan_for_model", "plannable_linears"]
