"""Native CPU kernels, compiled on first use and called through ctypes.

`paged_decode` reads K/V in place through block tables (no gather, no padding). The shared
object is built once per source and CPU (g++ -O3 -march=native -fopenmp) into
~/.cache/pagoda; torch's own libgomp is already loaded, so both share one OpenMP pool. If no
compiler is available, `available()` is False and attention falls back to torch ops.
Set PAGODA_DISABLE_CPU_KERNELS=1 to force the fallback.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger("pagoda")

_SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "paged_attention_cpu.cpp"
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
_FUNCS = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16", torch.float16: "paged_decode_f16"}
_lib: ctypes.CDLL | None = None
_tried = False


def _cache_path() -> Path:
    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode() + _cpu_id().encode()).hexdigest()[:16]
    root = Path(os.environ.get("PAGODA_CACHE_DIR", Path.home() / ".cache" / "pagoda"))
    return root / "kernels" / f"paged_attention_cpu-{key}.so"


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


def _build(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(suffix=".so", dir=target.parent, delete=False) as tmp:
        subprocess.run(["g++", *_FLAGS, str(_SOURCE), "-o", tmp.name], check=True, capture_output=True, timeout=300)
        os.replace(tmp.name, target)


def _load() -> ctypes.CDLL | None:
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("PAGODA_DISABLE_CPU_KERNELS"):
        return None
    try:
        target = _cache_path()
        if not target.exists():
            _build(target)
        lib = ctypes.CDLL(str(target))
        for name in _FUNCS.values():
            fn = getattr(lib, name)
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int64]
        _lib = lib
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("CPU attention kernel unavailable (%s); using the torch fallback", exc)
    return _lib


def available() -> bool:
    return _load() is not None


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """Attention of one query per sequence over its paged context.

    Args:
        q: [batch, num_heads, head_dim], contiguous.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        block_tables: int64 [batch, max_blocks]; context_lens: int64 [batch].
    """
    lib = _load()
    assert lib is not None
    q = q.contiguous()
    out = torch.empty_like(q)
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    getattr(lib, _FUNCS[q.dtype])(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        context_lens.data_ptr(), out.data_ptr(), batch, num_heads, num_kv_heads, head_dim,
        block_size, block_tables.shape[1], scale, window)
    return out
