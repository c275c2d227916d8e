"""RMSNorm, computed as Hugging Face does (in float32, cast back before the weight).

`forward_with_residual` is the pre-norm block's "add the residual, then normalize": vLLM's
fused_add_rms_norm. Where the CPU kernels take x (`cpu_kernels.takes`) both run one kernel call
with the same rounding points; the fused form then updates x and residual in place.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.layers import cpu_kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() in (2, 3) and cpu_kernels.takes(x) and x.stride(-1) == 1:
            # NOTE: rows as they are (strided ones too); Qwen3's q/k heads [T, H, D] as T x H rows,
            # the kernel the native stack runs on them (a copy unless a view).
            return cpu_kernels.ops.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def forward_with_residual(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual); the native path reuses both buffers."""
        if x.is_contiguous() and residual.is_contiguous() and cpu_kernels.takes(x):
            cpu_kernels.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = x + residual
        return self.forward(residual), residual


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x normalized, times (1 + weight), all in float32 and cast back once
    (Hugging Face's Gemma3RMSNorm); its own kernel where the CPU kernels take x (the scale
    1 + weight in fp32, made once per weight), the same two fp32 products and one rounding."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        self._scale: tuple[tuple[int, int], torch.Tensor] | None = None

    def scale(self) -> torch.Tensor:
        """1 + weight in fp32, remade when the weight changes (loading writes it)."""
        key = (self.weight.data_ptr(), self.weight._version)
        if self._scale is None or self._scale[0] != key:
            self._scale = (key, (1.0 + self.weight.float()).contiguous())
        return self._scale[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels.takes(x) and x.stride(-1) == 1:
            rows = x.reshape(-1, x.shape[-1])  # NOTE: q/k heads [T, H, D]: a copy unless a view
            return cpu_kernels.ops.gemma_rms_norm(rows, self.scale(), self.eps).view(x.shape)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)

    def forward_with_residual(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual); the kernel path reuses both buffers."""
        if x.dim() == 2 and x.is_contiguous() and residual.is_contiguous() and cpu_kernels.takes(x):
            cpu_kernels.ops.fused_add_gemma_rms_norm(x, residual, self.scale(), self.eps)
            return x, residual
        residual = x + residual
        return self.forward(residual), residual
