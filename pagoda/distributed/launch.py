"""Joining the ranks: torch.distributed's TCP rendezvous, then the tensor-parallel groups.

Every rank (on every node) calls `join` with the same address and world size; gloo carries
CPU tensors, NCCL CUDA ones. Then each rank learns its `ParallelGroup` and `PipelineStage`
(`layout`): world rank r is tensor-parallel rank r % T of stage r // T; every rank creates
every stage's group, in the same order, as torch.distributed requires. A stage of several
ranks also gets a control group (`control_group`: gloo, whatever the device) on which its ranks
agree that a step failed on all of them.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from pagoda.distributed.group import ParallelGroup, PipelineStage, split_layers

TIMEOUT = datetime.timedelta(minutes=10)
# NOTE: ranks that fail a step alike (the same inputs, the same code) reach the agreement
# within moments of each other; a rank whose peers did not fail waits this long, then ends.
AGREE_TIMEOUT = datetime.timedelta(seconds=60)


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


def control_group(rank: int, tp_size: int, pp_size: int,
                  timeout: datetime.timedelta = AGREE_TIMEOUT) -> Any:
    """This rank's stage's control group (None for a stage of one rank; creates every
    stage's): a gloo group apart from the one the layers use, so that a failure agreement
    never pairs with a collective a peer is still inside."""
    if tp_size == 1:
        return None
    groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size)), timeout=timeout, backend="gloo") for s in range(pp_size)]
    return groups[rank // tp_size]


def all_failed(control: Any) -> bool:
    """Whether every rank of this stage failed the step too (call only after failing):
    they all reach this agreement at once; a peer that did not fail is inside a collective
    of the layers' group or waiting for the next step, and the wait times out."""
    if control is None:
        return True
    try:
        dist.all_reduce(torch.ones(1), group=control)
    except RuntimeError:
        return False
    return True


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
