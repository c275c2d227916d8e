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
from pagoda.layers import cpu_kernels
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
    """Token embeddings; rank r holds the rows of ids [r * V/T, (r + 1) * V/T).

    Tied to the LM head (`tie`: the model's constructor, where the checkpoint ties them), the
    table is the head's weight; once quantization packs the head and frees that float table,
    the embedding looks its rows up in the head's records (the method's `dequantize`, only the
    rows it gathers), so the table is stored once, quantized, and the module stays itself.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: ParallelGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.start, self.num_rows = tp.shard(vocab_size, "vocab_size")
        self.weight = nn.Parameter(torch.empty(self.num_rows, hidden_size), requires_grad=False)
        self.weight.weight_loader = self._load_rows  # type: ignore[attr-defined]
        # NOTE: a plain reference, not a submodule: the head is the model's, registered there.
        self.__dict__["tied_head"] = None

    def tie(self, head: Linear) -> None:
        """Shares this table with the LM head `head` (one parameter, read from both)."""
        head.weight = self.weight
        self.__dict__["tied_head"] = head

    def _load_rows(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded.narrow(0, self.start, param.shape[0]))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._rows(ids)
        local = ids - self.start
        mine = (local >= 0) & (local < self.num_rows)
        out = self._rows(local.clamp(0, self.num_rows - 1))
        out[~mine] = 0
        return self.tp.all_reduce(out)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The table's rows `ids`: from the float table, or from the tied head's packed records
        once its float weight was freed."""
        head = self.__dict__["tied_head"]
        if self.weight.numel() or head is None:
            return F.embedding(ids, self.weight)
        return head.method.dequantize(self.weight.dtype, cpu_kernels.takes(ids), ids)  # type: ignore[attr-defined]

    @property
    def reads_packed_head(self) -> bool:
        """Whether the rows come from the tied head's packed records (its float table freed)."""
        return not self.weight.numel() and self.__dict__["tied_head"] is not None


class ParallelLMHead(ColumnParallelLinear):
    """Logits over the vocabulary: each rank projects its rows; every rank gets them all."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: ParallelGroup = SINGLE) -> None:
        super().__init__(hidden_size, vocab_size, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather(super().forward(x), dim=-1)
