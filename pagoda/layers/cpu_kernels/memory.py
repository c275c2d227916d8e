"""Huge pages under the CPU KV pool.

Decode attention reads cached K/V rows from blocks scattered over the pool; with 4 KB pages
nearly every tile is a TLB miss. Where transparent huge pages are in `madvise` mode (the
default here) memory must ask before it is first touched; the CPU pool is allocated with
`torch.empty` and first written by the slot-write kernel, so advising it at bind time works.
Measured: decode attention over 30 cold layers 5-15% faster (docs/performance.md, Kernels).
A hint only: where the kernel declines, the pool stays in small pages and works the same.
"""

from __future__ import annotations

import ctypes
import sys

import torch

_MADV_HUGEPAGE = 14
_PAGE = 4096
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
