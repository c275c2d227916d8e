"""Checked kernel inputs: indices the kernels would follow into memory, tested first.

The native kernels trust their index tensors: a slot past the pool, a block id past the
pool, a position past the rotary tables or a sequence length past its block table would
read or write outside a buffer (heap corruption, or a wrong answer), not raise. With
`PAGODA_CHECK_KERNEL_INPUTS=1` every kernel call that follows indices (`paged_attention`,
`reshape_and_cache`, `rotary_inplace`, and the one-call decoder stack, whose kernels take the
same indices) checks them against the sizes of what they index, and an engine bug becomes a
`KernelInputError` naming the tensor and the bad value; the engine's isolation then fails
the step's culprit request, and nothing is corrupted. Off by default: a check costs a few
tensor reductions per call (~400 calls a decode step). The test suite runs an engine
workload with it on (tests/test_kernel_checks.py).
"""

from __future__ import annotations

import os

import torch

ENABLED = os.environ.get("PAGODA_CHECK_KERNEL_INPUTS", "") not in ("", "0")


class KernelInputError(IndexError):
    """An index a native kernel was about to follow lies outside what it indexes."""


def _index_tensor(name: str, t: torch.Tensor, length: int | None = None) -> None:
    if t.dtype != torch.int64 or not t.is_contiguous():
        raise KernelInputError(f"{name} must be a contiguous int64 tensor, got {t.dtype}, strides {t.stride()}")
    if length is not None and t.numel() != length:
        raise KernelInputError(f"{name} has {t.numel()} entries, the kernel reads {length}")


def _range(name: str, t: torch.Tensor, low: int, high: int) -> None:
    """Every entry of t in [low, high)."""
    if t.numel() and (int(t.min()) < low or int(t.max()) >= high):
        bad = t[(t < low) | (t >= high)][0]
        raise KernelInputError(f"{name} holds {int(bad)}, outside [{low}, {high})")


def slots(slot_mapping: torch.Tensor, num_tokens: int, pool: torch.Tensor) -> None:
    """Slot t of `num_tokens` is < 0 (skipped) or inside the pool [num_blocks, block_size, ...]."""
    _index_tensor("slot_mapping", slot_mapping, num_tokens)
    _range("slot_mapping", slot_mapping, -(1 << 62), pool.shape[0] * pool.shape[1])


def positions(pos: torch.Tensor, num_tokens: int, table: torch.Tensor) -> None:
    """Rotary positions inside the cos/sin table's rows."""
    _index_tensor("positions", pos, num_tokens)
    _range("positions", pos, 0, table.shape[0])


def paged(pool: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
          query_start_loc: torch.Tensor, num_tokens: int) -> None:
    """Block tables, context lengths and query rows of a paged-attention call.

    Each sequence's query rows lie inside the step's `num_tokens` rows and are at most its
    context; its context fits its block-table row; every block id it reads is in the pool."""
    num_seqs = seq_lens.numel()
    _index_tensor("seq_lens", seq_lens)
    _index_tensor("query_start_loc", query_start_loc, num_seqs + 1)
    if block_tables.dtype != torch.int64 or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs \
            or block_tables.stride(1) != 1 or block_tables.stride(0) != block_tables.shape[1]:
        raise KernelInputError(f"block_tables must be a contiguous int64 [{num_seqs}, max_blocks] tensor, "
                               f"got {block_tables.dtype} {tuple(block_tables.shape)}")
    starts = query_start_loc
    rows = starts[1:] - starts[:-1]
    if num_seqs and (int(starts[0]) != 0 or int(starts[-1]) > num_tokens or int(rows.min()) < 0):
        raise KernelInputError(f"query_start_loc {starts.tolist()[:8]} does not split {num_tokens} rows")
    if num_seqs and int((seq_lens - rows).min()) < 0:
        raise KernelInputError("a sequence has more query rows than context tokens (seq_lens)")
    block_size = pool.shape[1]
    _range("seq_lens", seq_lens, 1, block_tables.shape[1] * block_size + 1)
    used = torch.arange(block_tables.shape[1])[None, :] < ((seq_lens + block_size - 1) // block_size)[:, None]
    _range("block_tables", block_tables[used], 0, pool.shape[0])
