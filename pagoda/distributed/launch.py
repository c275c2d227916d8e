"""Joining the ranks: torch.distributed's TCP rendezvous, then the tensor-parallel groups.

Every rank (on every node) calls `join` with the same address and world size; gloo carries
CPU tensors, NCCL CUDA ones. Then each rank learns its `ParallelGroup` and `PipelineStage`
(`layout`): world rank r is tensor-parallel rank r % T of stage r // T; every rank creates
every stage's group, in the same order, as torch.distributed requires.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from pagoda.distributed.group import ParallelGroup, PipelineStage, split_layers

TIMEOUT = datetime.timedelta(minutes=10)


def join(rank: int, world_size: int, init_addr: str, device: torch.device) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{init_addr}", rank=rank,
                            world_size=world_size, timeout=TIMEOUT)


def layout(rank: int, tp_size: int, pp_size: int, num_layers: int
           ) -> tuple[ParallelGroup, PipelineStage]:
    """This rank's tensor-parallel group and pipeline stage (creates every TP group)."""
    groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size))) if tp_size > 1 else None
              for s in range(pp_size)]
    stage_index, tp_rank = divmod(rank, tp_size)
    first, end = split_layers(num_layers, pp_size)[stage_index]
    stage = PipelineStage(
        index=stage_index, size=pp_size, first_layer=first, end_layer=end,
        prev_rank=rank - tp_size if stage_index > 0 else None,
        next_rank=rank + tp_size if stage_index < pp_size - 1 else None)
    return ParallelGroup(tp_rank, tp_size, groups[stage_index]), stage


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
