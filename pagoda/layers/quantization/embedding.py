"""The token embedding read from a quantized, tied LM head.

With tied embeddings the LM head's weight is the embedding table; once the head is packed, the
embedding looks its rows up in the same records and dequantizes only the rows it gathers, so
the table is stored once, quantized. Vocabulary-parallel like `VocabParallelEmbedding`:
rank r holds ids [start, start + rows); the others' rows are zero before the sum.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.distributed.group import SINGLE, ParallelGroup
from pagoda.layers import cpu_kernels
from pagoda.layers.quantization.methods import Fp8LinearMethod, PackedLinearMethod


class QuantizedEmbedding(nn.Module):
    def __init__(self, method: PackedLinearMethod | Fp8LinearMethod, dtype: torch.dtype, rows: int,
                 start: int = 0, tp: ParallelGroup = SINGLE) -> None:
        super().__init__()
        self.method = method
        self.dtype = dtype
        self.rows = rows
        self.start = start
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.rows
        if self.tp.size == 1:
            return self.method.dequantize(self.dtype, cpu_kernels.takes(ids), ids)
        local = ids - self.start
        mine = (local >= 0) & (local < rows)
        out = self.method.dequantize(self.dtype, cpu_kernels.takes(ids), local.clamp(0, rows - 1))
        out[~mine] = 0
        return self.tp.all_reduce(out)
