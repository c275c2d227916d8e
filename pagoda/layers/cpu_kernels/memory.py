"""Where big CPU buffers live: the packed weights in huge pages, the KV pool untouched.

A decode step streams every packed weight once, in layer order. With each weight its own
allocation in 4 KB pages the GEMM read them ~8% slower than the same threads stream one flat
buffer (docs/benchmarks/kernels/weight_stream.py); `huge_page_buffer` gives one 2 MB-aligned
buffer advised MADV_HUGEPAGE
before its first touch (transparent huge pages in `madvise` mode, the default here, need the
advice first), which the weights are packed or gathered into in the order a step reads them:
a step at one stream ~10% faster (docs/performance.md, Packed weights in huge pages). A hint
only: where the kernel declines, the buffer stays in small pages and works the same.
The KV pool is not advised: its blocks are committed as they are first written, and with
2 MB pages one short request would commit 2 MB in each of its 60 tensors (~120 MB); each
tensor gets a mapping of its own (`untouched`), never reused heap space.
"""

from __future__ import annotations

import ctypes
import mmap
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


def untouched(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] in an anonymous mapping of its own, not yet touched.

    NOTE: not `torch.empty`: malloc serves big requests from free heap space first (the plain
    weights freed at packing, ~200 MB), and a pool placed there kept part of that space
    resident (`resident_memory.py`: 733 MB against 663)."""
    if not hasattr(mmap, "MAP_ANONYMOUS"):  # NOTE: Windows: no flags; the allocator then
        return torch.empty(nbytes, dtype=torch.uint8)
    mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes]


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes], 2 MB-aligned, advised for huge pages and not yet touched (its first write
    faults them in)."""
    raw = untouched(nbytes + _HUGE_PAGE)
    start = -raw.data_ptr() % _HUGE_PAGE
    buffer = raw[start:start + nbytes]
    advise_huge_pages(buffer)
    return buffer


def huge_page_slices(sizes: list[int]) -> list[torch.Tensor]:
    """Consecutive uint8 slices of one `huge_page_buffer`, one per size, each 64-byte aligned
    (each keeps the buffer alive)."""
    aligned = [-(-n // _ALIGN) * _ALIGN for n in sizes]
    buffer = huge_page_buffer(sum(aligned))
    starts = [sum(aligned[:i]) for i in range(len(sizes))]
    return [buffer[start:start + n] for start, n in zip(starts, sizes, strict=True)]


def gather_in_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies CPU tensors, in order, into `huge_page_slices`; returns them (same dtype and shape)."""
    slices = huge_page_slices([t.numel() * t.element_size() for t in tensors])
    return [s.view(t.dtype).view(t.shape).copy_(t) for s, t in zip(slices, tensors, strict=True)]
