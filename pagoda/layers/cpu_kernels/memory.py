"""Huge pages under the CPU KV pool and the packed weights.

Decode attention reads cached K/V rows from blocks scattered over the pool; with 4 KB pages
nearly every tile is a TLB miss. Where transparent huge pages are in `madvise` mode (the
default here) memory must ask before it is first touched; the CPU pool is allocated with
`torch.empty` and first written by the slot-write kernel, so advising it at bind time works.
Measured: decode attention over 30 cold layers 5-15% faster (docs/performance.md, Kernels).
A decode step streams every packed weight once, in layer order: `gather_in_huge_pages` copies
them into one buffer, in that order, advised before its first touch (a step at one stream
reads them ~10% faster: docs/performance.md, Weights in huge pages).
A hint only: where the kernel declines, memory stays in small pages and works the same.
"""

from __future__ import annotations

import ctypes
import sys

import torch

_MADV_HUGEPAGE = 14
_PAGE = 4096
_HUGE_PAGE = 2 << 20
_ALIGN = 64
_madvise: ctypes._CFuncPtr | None = None  # type: ignore[name-defined]


def advise_huge_pages(t: torch.Tensor) -> None:
    """Asks for huge pages under a CPU tensor's memory (pages already touched are unaffected)."""
    global _madvise
    if t.device.type != "cpu" or not t.numel() or not sys.platform.startswith("linux"):
        return
    if _madvise is None:
        _madvise = ctypes.CDLL(None).madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = t.data_ptr()
    aligned = -(-start // _PAGE) * _PAGE
    length = t.numel() * t.element_size() - (aligned - start)
    if length > 0:
        _madvise(aligned, length, _MADV_HUGEPAGE)


def gather_in_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies CPU tensors, in order, into one 2 MB-aligned buffer advised for huge pages; returns
    views of it, one per tensor (same dtype and shape; each keeps the buffer alive)."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // _ALIGN) * _ALIGN
    raw = torch.empty(total + _HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % _HUGE_PAGE
    advise_huge_pages(raw[start:start + total])
    return [raw[start + o:start + o + size].view(t.dtype).view(t.shape).copy_(t)
            for t, o, size in zip(tensors, offsets, sizes, strict=True)]
