"""Linear layers whose parameters carry their own `weight_loader`.

Fused projections (q/k/v, gate/up) are one GEMM each; the checkpoint's separate tensors are
copied into their slice by shard index, so the loader stays a dictionary lookup.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not match parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dimension."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = output_sizes
        self.weight.weight_loader = self._shard_loader  # type: ignore[attr-defined]
        if self.bias is not None:
            self.bias.weight_loader = self._shard_loader  # type: ignore[attr-defined]

    def _shard_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        start = sum(self.output_sizes[:shard])
        size = self.output_sizes[shard]
        if loaded.shape[0] != size:
            raise ValueError(f"shard {shard} has {loaded.shape[0]} rows, expected {size}")
        param.data.narrow(0, start, size).copy_(loaded)
