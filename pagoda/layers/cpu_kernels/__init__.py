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
    """The avx512bf16 build's GEMM tile kind by row count (gemm_tiles.py): cached, else measured."""
    if lib.variant != "avx512bf16":
        # one kind: nothing to choose or key the plan by
        ops.GEMM_FMA_ROWS = ops.GEMM_AMX_ROWS = ops.GEMM_AMX_INT8_ROWS = gemm_tiles.NEVER
        return
    probe: dict[str, ops.PackedWeight | ops.Int8Panels] = {}

    def weight(kind: str) -> ops.PackedWeight | ops.Int8Panels:
        if kind not in probe:  # NOTE: its own generator: loading the kernels leaves torch's RNG alone
            gen = torch.Generator().manual_seed(0)
            shape = (512, gemm_tiles.PROBE_K)
            probe[kind] = (ops.PackedWeight((torch.randn(shape, generator=gen) * 0.05).to(torch.bfloat16))
                           if kind == "bf16" else
                           ops.Int8Panels(torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8),
                                          torch.rand(shape[0], generator=gen) * 0.01))
        return probe[kind]

    cache = gemm_tiles.cache_path([*loader.cpu_identity(), lib.path.stem, str(torch.get_num_threads())])
    has_amx = ops.set_gemm_amx_rows(gemm_tiles.NEVER)
    int8_amx = ops.set_gemm_amx_int8_rows(gemm_tiles.NEVER)
    gemm_tiles.choose(_apply_tiles, lambda x: ops.gemm(x, weight("bf16")), gemm_tiles.PROBE_K, cache, retune,
                      amx=has_amx, run_int8=(lambda x: ops.gemm(x, weight("int8"))) if int8_amx else None)


def _apply_tiles(choice: gemm_tiles.TileChoice) -> None:
    ops.set_gemm_fma_rows(choice.fma_rows)
    granted = ops.set_gemm_amx_rows(choice.amx_rows)
    granted = ops.set_gemm_amx_int8_rows(choice.amx_int8_rows) and granted
    if not granted and min(choice.amx_rows, choice.amx_int8_rows) < gemm_tiles.NEVER:
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
