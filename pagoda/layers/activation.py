"""Gated activations over a fused gate/up projection: SiLU-and-multiply (one kernel call where
the CPU kernels take x) and GELU-and-multiply (GeGLU, torch)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.layers import cpu_kernels


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_contiguous() and cpu_kernels.takes(x):
            return cpu_kernels.ops.silu_and_mul(x)
        return silu_and_mul(x)


class GeluAndMul(nn.Module):
    """GELU(gate) * up (Gemma's GeGLU); `approximate` is torch's: 'tanh' or 'none'."""

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        if approximate not in ("tanh", "none"):
            raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.approximate == "tanh" and x.is_contiguous() and cpu_kernels.takes(x):
            return cpu_kernels.ops.gelu_tanh_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up
