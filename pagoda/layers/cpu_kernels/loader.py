"""Finding, loading and binding the compiled kernels.

The variant comes from the CPU's flags (`avx512bf16` where AVX-512 F/BW/VL, AVX512_BF16 and
AVX512_VNNI are all present, else `avx2` where AVX2, FMA and F16C are, else `portable`), or from
PAGODA_CPU_KERNEL_VARIANT. The library is looked up in
the package's build folder (written by `make install`), then in the user cache; if neither
holds a build of the current sources, it is compiled into the first writable one, with a
warning (the first request would otherwise pay for it). PAGODA_DISABLE_CPU_KERNELS=1 disables
everything: `library()` is then None and every layer takes its torch path.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch

from pagoda.layers.cpu_kernels import build

logger = logging.getLogger("pagoda")

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
ArgTypes = list[type]
_DTYPED: dict[str, ArgTypes] = {
    "rotary": [_P] * 4 + [_L, _I, _I, _L, _L],
    "hadamard": [_P, _L, _I, _I, _L, _L],
    "rms_norm": [_P] * 3 + [_L, _I, _L, _L, _F],
    "fused_add_rms_norm": [_P] * 3 + [_L, _I, _F],
    "gemma_rms_norm": [_P] * 3 + [_L, _I, _L, _L, _F],
    "fused_add_gemma_rms_norm": [_P] * 3 + [_L, _I, _F],
    "silu_and_mul": [_P] * 2 + [_L, _I],
    "gelu_tanh_and_mul": [_P] * 2 + [_L, _I],
    "qgemv": [_I, _P, _L, _P, _L, _L, _P, _P, _L, _L, _L, _L, _I],
    "dequantize": [_I, _P, _L, _L, _P, _L, _L],
    "argmax_rows": [_P, _P, _L, _L, _L],
}
# Bound per (activation dtype, KV cache dtype): the cache may hold one-byte fp8.
_CACHE_TYPED: dict[str, ArgTypes] = {
    "paged_attention": [_P] * 7 + [_I] * 6 + [_L, _L, _F, _L, _F, _F],
    "reshape_and_cache": [_P] * 5 + [_L] * 4 + [_F, _F],
}
_PLAIN: dict[str, ArgTypes] = {
    "gemv_bf16": [_P, _L, _P, _P, _P, _L, _L, _L, _L],
    "gemm_packed": [_P, _P, _L, _P, _P, _L, _L],
    "gemm_pack_bf16": [_P, _L, _P, _L, _L],
    "set_num_threads": [_I],
    "decoder_stack_bf16": [_P, _P, _L],
    "fused_moe_bf16": [_P, _P, _P, _L],
    "abi_sizes": [_P],
    "philox_uniform": [ctypes.c_uint64, _P, _L, _L, _L, _P],
    "top_candidates": [_P, _L, _L, _L, _P, _L, _P, _P, _P],
    "draw_rows": [_P, _L, _L, _L, _P, _P, _P],
}
# NOTE: the order of `pagoda_abi_sizes`'s output (pagoda/csrc/decoder.cpp).
ABI_STRUCTS = ("GemmWeight", "LinearWeight", "DecoderLayer", "DecoderStack", "DecodeStep", "StepGroup",
               "LoraUpdate", "LoraRun", "MoeLayer")


class AbiMismatchError(RuntimeError):
    """A ctypes mirror of a native struct has another size than the loaded library's."""
_RETURNING: dict[str, tuple[ArgTypes, type]] = {
    "gemm_packed_size_bf16": ([_L, _L], _L),
    "gemm_int8_format": ([], _L),
    "gemm_int8_narrow": ([], _L),
    "gemm_int5": ([], _L),
    "gemm_rows_bf16": ([_P, _P, _L, _P], _L),
    "gemm_int8_f32_groups": ([], _L),
    "gemm_int8_f32_bias": ([], _L),
    "gemm_int8_f32_wide": ([], _L),
    "gemm_set_fma_rows": ([_L], _L),
    "gemm_set_amx_rows": ([_L], _L),
    "gemm_set_prefetch_rows": ([_L], _L),
    "gemm_set_amx_integer_rows": ([_L, _L], _L),
    "qgemv_x_group": ([_L, _L], _L),
    "gemm_packed_gated": ([_P, _P, _L, _P, _P, _L, _L, _L], _L),
}
SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
CACHE_SUFFIXES = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


_AVX512_BF16 = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
# NOTE: build.VARIANTS lists the variants best first; each needs these /proc/cpuinfo flags.
REQUIRED_FLAGS = {"avx512bf16": _AVX512_BF16, "avx2": {"avx2", "fma", "f16c", "bmi2"}}


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((x for x in f if x.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


# The flags that decide which kernels and matrix units a CPU has (named beside every figure).
MATRIX_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


def cpu_model() -> str:
    """/proc/cpuinfo's model name ('' where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((x.partition(":")[2].strip() for x in f if x.startswith("model name")), "")
    except OSError:
        return ""


def pick_variant() -> str:
    forced = os.environ.get("PAGODA_CPU_KERNEL_VARIANT")
    if forced:
        if forced not in build.VARIANTS:
            raise ValueError(f"PAGODA_CPU_KERNEL_VARIANT={forced!r}; known: {sorted(build.VARIANTS)}")
        return forced
    return next(v for v in build.VARIANTS if runs_here(v))


def runs_here(variant: str) -> bool:
    """Whether this CPU has every instruction set `variant` is compiled for."""
    needed = REQUIRED_FLAGS.get(variant, set())
    return not needed or (build.IS_X86 and needed <= cpu_flags())


class KernelLibrary:
    """One loaded variant: `fn(name, dtype)` returns the bound C function."""

    def __init__(self, path: Path, variant: str) -> None:
        self.path = path
        self.variant = variant
        self._cdll = ctypes.CDLL(str(path))
        self.fns: dict[str, ctypes._CFuncPtr] = {}  # type: ignore[name-defined]
        self._typed: dict[tuple[str, torch.dtype], ctypes._CFuncPtr] = {}  # type: ignore[name-defined]
        self._cache_typed: dict[tuple[str, torch.dtype, torch.dtype], ctypes._CFuncPtr] = {}  # type: ignore[name-defined]
        for base, argtypes in _DTYPED.items():
            for dtype, suffix in SUFFIXES.items():
                self._bind(f"{base}_{suffix}", argtypes)
                self._typed[(base, dtype)] = self.fns[f"{base}_{suffix}"]
        for base, argtypes in _CACHE_TYPED.items():
            for dtype, suffix in SUFFIXES.items():
                self._bind(f"{base}_{suffix}", argtypes)
                self._typed[(base, dtype)] = self._cache_typed[(base, dtype, dtype)] = self.fns[f"{base}_{suffix}"]
                for cache_dtype, cache_suffix in CACHE_SUFFIXES.items():
                    name = f"{base}_{suffix}_{cache_suffix}"
                    self._bind(name, argtypes)
                    self._cache_typed[(base, dtype, cache_dtype)] = self.fns[name]
        for name, argtypes in _PLAIN.items():
            self._bind(name, argtypes)
        for name, (argtypes, restype) in _RETURNING.items():
            self._bind(name, argtypes, restype)
        self.fns["set_num_threads"](torch.get_num_threads())
        sizes = (ctypes.c_int64 * len(ABI_STRUCTS))()
        self.fns["abi_sizes"](sizes)
        self.abi_sizes = dict(zip(ABI_STRUCTS, sizes, strict=True))

    def check_abi(self, mirrors: dict[str, type[ctypes.Structure]]) -> None:
        """Raises `AbiMismatchError` if a ctypes mirror's size differs from its native struct's."""
        wrong = [f"{name}: {ctypes.sizeof(mirror)} bytes here, {self.abi_sizes[name]} in {self.path.name}"
                 for name, mirror in mirrors.items() if ctypes.sizeof(mirror) != self.abi_sizes[name]]
        if wrong:
            raise AbiMismatchError("pagoda's mirror of the native kernels' structs does not match the "
                                   f"library ({'; '.join(wrong)}): rebuild them (make install)")

    def _bind(self, name: str, argtypes: ArgTypes, restype: type | None = None) -> None:
        fn = getattr(self._cdll, f"pagoda_{name}")
        fn.argtypes = argtypes
        fn.restype = restype
        self.fns[name] = fn

    def fn(self, name: str, dtype: torch.dtype | None = None) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
        return self.fns[name] if dtype is None else self._typed[(name, dtype)]

    def cache_fn(self, name: str, dtype: torch.dtype, cache_dtype: torch.dtype) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
        """The variant of `name` for activations of `dtype` and a KV pool of `cache_dtype`."""
        return self._cache_typed[(name, dtype, cache_dtype)]


def cache_root() -> Path:
    """pagoda's cache folder ($PAGODA_CACHE_DIR, else ~/.cache/pagoda): kernel builds, plans, choices."""
    return Path(os.environ.get("PAGODA_CACHE_DIR", Path.home() / ".cache" / "pagoda"))


def cpu_identity() -> list[str]:
    """The CPU model and all its flags: what a measured kernel choice is keyed by."""
    return [cpu_model(), " ".join(sorted(cpu_flags()))]


def _search_dirs() -> list[Path]:
    cache = cache_root() / "kernels"
    return [build.default_build_dir(), cache]


def locate(variant: str) -> Path:
    """The library for `variant`, compiled first (with a warning) if no current build exists."""
    name = build.library_name(variant)
    dirs = _search_dirs()
    for d in dirs:
        if (d / name).exists():
            return d / name
    logger.warning("CPU kernels (%s) not built by `make install` for these sources; compiling now", variant)
    for d in dirs:
        try:
            return build.build(variant, d)
        except PermissionError:
            continue
    raise build.BuildError(f"no writable folder for the CPU kernels among {dirs}")


def load(variant: str | None = None) -> KernelLibrary | None:
    """Loads a variant (the CPU's by default); None when disabled or impossible, with a warning."""
    if os.environ.get("PAGODA_DISABLE_CPU_KERNELS"):
        return None
    variant = variant or pick_variant()
    if not runs_here(variant):
        logger.warning("CPU kernels (%s) need instructions this CPU lacks: %s", variant,
                       sorted(REQUIRED_FLAGS[variant] - cpu_flags()))
        return None
    try:
        return KernelLibrary(locate(variant), variant)
    except (OSError, build.BuildError) as exc:
        logger.warning("CPU kernels unavailable (%s); using the torch fallback", exc)
        return None
