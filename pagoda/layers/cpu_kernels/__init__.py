"""pagoda's native CPU kernels: decode/prefix attention over the paged pool, the K/V slot
write, rotary in place, RMSNorm (fused with the residual add), SiLU-and-mul, and a bf16
matrix-vector product for small batches.

`available()` says whether a library is loaded (it is loaded once, on first use); a layer
calls `ops` instead of torch for a tensor the kernels take (`takes`: on the CPU, a library
loaded), so nothing is set on a model from outside.
Invariant: with PAGODA_DISABLE_CPU_KERNELS=1, or when nothing can be loaded, nothing here is
called and every layer runs its pure-torch path, on any device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagoda.layers.cpu_kernels import gemm_tiles, loader, ops
from pagoda.layers.cpu_kernels.loader import KernelLibrary, load

_library: KernelLibrary | None = None
_loaded = False


def library() -> KernelLibrary | None:
    global _library, _loaded
    if not _loaded:
        _library, _loaded = _adopt(load()), True
    return _library


def _adopt(lib: KernelLibrary | None) -> KernelLibrary | None:
    """Makes `lib` the one `ops` calls, once its structs match ours (`AbiMismatchError`)."""
    if lib is not None:
        lib.check_abi({"GemmWeight": ops.GemmWeight})
    ops.LIB = lib
    if lib is not None:
        choose_gemm_tiles(lib)
    return lib


def choose_gemm_tiles(lib: KernelLibrary, retune: bool = False) -> None:
    """The avx512bf16 and avx2 builds' GEMM tile kind by row count (gemm_tiles.py): cached, else measured."""
    if lib.variant not in gemm_tiles.BUILDS:
        # one kind: nothing to choose or key the plan by
        ops.GEMM_FMA_ROWS = ops.GEMM_AMX_ROWS = gemm_tiles.NEVER
        ops.GEMM_AMX_INTEGER_ROWS.update({8: gemm_tiles.NEVER, 4: gemm_tiles.NEVER})
        ops.GEMM_PREFETCH_ROWS = gemm_tiles.DEFAULT_PREFETCH_ROWS
        return
    probe: dict[str, ops.PackedWeight | ops.Int8Panels | ops.Int4Panels] = {}

    def weight(kind: str) -> ops.PackedWeight | ops.Int8Panels | ops.Int4Panels:
        if kind not in probe:  # NOTE: its own generator: loading the kernels leaves torch's RNG alone
            gen = torch.Generator().manual_seed(0)
            n, k = 512, gemm_tiles.PROBE_K
            if kind == "bf16":
                probe[kind] = ops.PackedWeight((torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16))
            elif kind == "stream":  # NOTE: zeros: only the stream's timing matters, and they are quick to make
                probe[kind] = ops.PackedWeight(torch.zeros(gemm_tiles.STREAM_PROBE_SHAPE, dtype=torch.bfloat16))
            elif kind == "int8":
                probe[kind] = ops.Int8Panels(torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8),
                                             torch.rand(n, generator=gen) * 0.01)
            else:
                dm = (torch.rand(n, k // 32, generator=gen) * 0.01).to(torch.float16)
                probe[kind] = ops.Int4Panels(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8), dm, -dm, 32)
        return probe[kind]

    def run(kind: str) -> Callable[[torch.Tensor], object]:
        return lambda x: ops.gemm(x, weight(kind))

    cache = gemm_tiles.cache_path([*loader.cpu_identity(), lib.path.stem, str(torch.get_num_threads())])
    has_amx = ops.set_gemm_amx_rows(gemm_tiles.NEVER)
    integer = {bits: run(f"int{bits}") for bits in (8, 4) if ops.set_gemm_amx_integer_rows(bits, gemm_tiles.NEVER)}
    gemm_tiles.choose(_apply_tiles, run("bf16"), gemm_tiles.PROBE_K, cache, retune, amx=has_amx,
                      run_integer=integer, run_stream=run("stream"), variant=lib.variant)


def _apply_tiles(choice: gemm_tiles.TileChoice) -> None:
    ops.set_gemm_fma_rows(choice.fma_rows)
    ops.set_gemm_prefetch_rows(choice.prefetch_rows)
    granted = ops.set_gemm_amx_rows(choice.amx_rows)
    for bits, rows in ((8, choice.amx_int8_rows), (4, choice.amx_int4_rows)):
        granted = ops.set_gemm_amx_integer_rows(bits, rows) and granted
    if not granted and min(choice.amx_rows, choice.amx_int8_rows, choice.amx_int4_rows) < gemm_tiles.NEVER:
        raise ValueError(f"{gemm_tiles.ENV}: AMX tiles asked for, but this CPU (or Linux) grants none "
                         "(no amx_bf16 in /proc/cpuinfo, or the tile data was refused); use dpbf16 or fma")


def available() -> bool:
    return library() is not None


def computes_bf16() -> bool:
    """Whether the loaded kernels multiply bf16 weights with vector instructions (the
    `avx512bf16` and `avx2` builds), so that a bf16 model is faster here than an fp32 one."""
    lib = library()
    return lib is not None and lib.variant != "portable"


def use_variant(variant: str | None) -> KernelLibrary | None:
    """Loads `variant` (None: the CPU's own) in place of the current library; for tests."""
    global _library, _loaded
    _library, _loaded = _adopt(load(variant)), True
    return _library


def takes(x: torch.Tensor) -> bool:
    """Whether a layer's kernel path runs for `x`: a CPU tensor, with a library loaded."""
    return x.device.type == "cpu" and library() is not None


__all__ = ["available", "choose_gemm_tiles", "computes_bf16", "library", "ops", "takes", "use_variant"]
