"""Copies tensors into one 2 MB-aligned buffer advised MADV_HUGEPAGE (benchmarks only)."""
import ctypes

import torch

def move_to_huge_pages(tensors):
    libc = ctypes.CDLL(None); libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    sizes = [-(-t.numel() * t.element_size() // 64) * 64 for t in tensors]
    raw = torch.empty(sum(sizes) + (2 << 20), dtype=torch.uint8)
    off = -raw.data_ptr() % (2 << 20); buf = raw[off:off + sum(sizes)]
    libc.madvise(buf.data_ptr(), sum(sizes) // 4096 * 4096, 14)
    out, o = [], 0
    for t, s in zip(tensors, sizes):
        v = buf[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape); v.copy_(t); out.append(v); o += s
    return out
