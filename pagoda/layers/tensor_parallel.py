"""Tensor-parallel layers: `Linear` subclasses and embeddings that hold one rank's shard.

Each parameter's `weight_loader` narrows the checkpoint's full tensor to this rank's shard, so
the model loader stays a dictionary lookup. The only collectives of tensor parallelism are
here: the row-parallel product and the vocabulary-parallel embedding sum over the group, the
vocabulary-parallel LM head gathers its logits. With a group of one every layer is exactly
the plain layer.

- column-parallel (q/k/v, gate/up): output rows split; the input is whole on every rank;
- row-parallel (o, down): input columns split; partial products summed (bias added once);
- vocabulary-parallel embedding and LM head: vocabulary rows split.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.distributed.group import SINGLE, ParallelGroup
from pagoda.layers.linear import Linear, MergedLinear


class ColumnParallelLinear(Linear):
    """y_r = x W_r^T: rank r holds output rows [r * out/T, (r + 1) * out/T)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp: ParallelGroup = SINGLE) -> None:
        start, local = tp.shard(output_size, "output size")
        super().__init__(input_size, local, bias)
        self.tp, self.shard_start = tp, start
        self.weight.weight_loader = self._load_rows  # type: ignore[attr-defined]
        if self.bias is not None:
            self.bias.weight_loader = self._load_rows  # type: ignore[attr-defined]

    def _load_rows(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded.narrow(0, self.shard_start, param.shape[0]))


class MergedColumnParallelLinear(MergedLinear):
    """Fused column-parallel projections (q/k/v, gate/up): each one split on its own."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 tp: ParallelGroup = SINGLE) -> None:
        local = [tp.shard(size, "a fused projection's size")[1] for size in output_sizes]
        super().__init__(input_size, local, bias)
        self.tp = tp
        self.fuse_checkpoint_parts(output_sizes)  # NOTE: a fused checkpoint tensor holds every rank's

    def _shard_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        size = self.output_sizes[shard]
        super()._shard_loader(param, loaded.narrow(0, self.tp.rank * size, size), shard)


class RowParallelLinear(Linear):
    """y = sum_r x_r W_r^T (+ b): rank r holds input columns; the sum is an all-reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp: ParallelGroup = SINGLE) -> None:
        start, local = tp.shard(input_size, "input size")
        super().__init__(local, output_size, bias)
        self.tp, self.shard_start = tp, start
        self.weight.weight_loader = self._load_columns  # type: ignore[attr-defined]

    def _load_columns(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded.narrow(1, self.shard_start, param.shape[1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        # NOTE: the bias joins after the sum, once, not once per rank.
        y = self.tp.all_reduce(self.project(x, None))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embeddings; rank r holds the rows of ids [r * V/T, (r + 1) * V/T)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: ParallelGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.start, local = tp.shard(vocab_size, "vocab_size")
        self.weight = nn.Parameter(torch.empty(local, hidden_size), requires_grad=False)
        self.weight.weight_loader = self._load_rows  # type: ignore[attr-defined]

    def _load_rows(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded.narrow(0, self.start, param.shape[0]))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        out[~mine] = 0
        return self.tp.all_reduce(out)


class ParallelLMHead(ColumnParallelLinear):
    """Logits over the vocabulary: each rank projects its rows; every rank gets them all."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: ParallelGroup = SINGLE) -> None:
        super().__init__(hidden_size, vocab_size, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather(super().forward(x), dim=-1)
