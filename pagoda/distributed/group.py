"""Where a process sits in the parallel layout, and the collectives its layers need.

World rank r of T x P ranks is tensor-parallel rank r % T of pipeline stage r // T. The model
receives its `ParallelGroup` and `PipelineStage` explicitly (no module-global state); with the
defaults (`SINGLE`, `WHOLE`) every collective is a no-op and the model is the plain one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ParallelGroup:
    """A tensor-parallel group: this rank, the group's size, and its process group."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def shard(self, total: int, what: str) -> tuple[int, int]:
        """(start, size) of this rank's equal share of `total`; refuses an uneven split."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size "
                             f"{self.size}.")
        size = total // self.size
        return self.rank * size, size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the group, in place."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim`, in rank order."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


@dataclass(frozen=True)
class PipelineStage:
    """A pipeline stage: its index, the number of stages, and the decoder layers it runs."""

    index: int = 0
    size: int = 1
    first_layer: int = 0
    end_layer: int | None = None  # None: to the last layer
    prev_rank: int | None = None  # world rank sending this stage its input
    next_rank: int | None = None  # world rank this stage sends its output to

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    def owns_layer(self, layer: int, num_layers: int) -> bool:
        end = num_layers if self.end_layer is None else self.end_layer
        return self.first_layer <= layer < end


SINGLE = ParallelGroup()
WHOLE = PipelineStage()


def split_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges, as even as possible (earlier stages take the remainder)."""
    if num_stages > num_layers:
        raise ValueError(f"pipeline_parallel_size ({num_stages}) exceeds the number of layers "
                         f"({num_layers}).")
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for s in range(num_stages):
        end = start + base + (1 if s < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges
