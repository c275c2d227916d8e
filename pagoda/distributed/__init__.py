"""Tensor and pipeline parallelism on torch.distributed (gloo on CPU, NCCL on CUDA).

`group.py`: this process's place (`ParallelGroup` for tensor parallelism, `PipelineStage` for
pipeline parallelism) and the collectives the parallel layers call. `launch.py`: the
rendezvous that joins every rank (one machine or several).
"""
