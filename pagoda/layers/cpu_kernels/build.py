"""Compiling pagoda's CPU kernels (`pagoda/csrc/*.cpp`) into shared libraries.

Three variants: `avx512bf16` (x86-64-v4 plus AVX512_BF16 and AVX512_VNNI: Cooper Lake, Zen 4,
Sapphire Rapids and later), `avx2` (x86-64-v3: AVX2, FMA, F16C; Haswell, Zen 1-3 and the
client cores without AVX-512) and `portable` (x86-64-v2 on x86, the compiler's default
elsewhere). The loader picks one at run
time from the CPU's flags. A library's file name carries a hash of the sources and flags,
so a stale build is never loaded. `make install` runs `python -m pagoda.layers.cpu_kernels`,
which writes into `pagoda/csrc/build/`; a missing compiler is an error there, with the fix.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CSRC = Path(__file__).resolve().parents[2] / "csrc"
SOURCES = ("attention.cpp", "cache.cpp", "decoder.cpp", "elementwise.cpp", "gemm.cpp", "gemv.cpp", "moe.cpp", "pool.cpp",
           "qgemv.cpp", "sampling.cpp")
HEADERS = ("gemm.h", "moe.h", "vec.h", "parallel.h")
COMMON_FLAGS = ("-O3", "-std=c++20", "-pthread", "-shared", "-fPIC", "-ffp-contract=off")
IS_X86 = platform.machine().lower() in ("x86_64", "amd64")
VARIANTS: dict[str, tuple[str, ...]] = {
    "avx512bf16": ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"),
    "avx2": ("-march=x86-64-v3",) if IS_X86 else (),
    "portable": ("-march=x86-64-v2",) if IS_X86 else (),
}


class BuildError(RuntimeError):
    """The kernels could not be compiled; the message says what to install or set."""


def compiler() -> str:
    """The C++ compiler to use ($CXX, else g++, else clang++); BuildError when none is found."""
    for name in (os.environ.get("CXX"), "g++", "clang++"):
        if name and shutil.which(name):
            return name
    raise BuildError("no C++ compiler found: pagoda's CPU kernels need g++ (or clang++) with C++20, "
                     "e.g. `apt-get install g++`, or set CXX; PAGODA_DISABLE_CPU_KERNELS=1 skips them "
                     "(slower torch fallback)")


def library_name(variant: str) -> str:
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update((CSRC / name).read_bytes())
    digest.update(" ".join((*COMMON_FLAGS, *VARIANTS[variant])).encode())
    return f"libpagoda_cpu-{variant}-{digest.hexdigest()[:12]}.so"


def default_build_dir() -> Path:
    return CSRC / "build"


def build(variant: str, out_dir: Path) -> Path:
    """Compiles one variant into out_dir (atomically); returns the library's path."""
    target = out_dir / library_name(variant)
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [compiler(), *COMMON_FLAGS, *VARIANTS[variant], *(str(CSRC / s) for s in SOURCES)]
    with tempfile.NamedTemporaryFile(suffix=".so", dir=out_dir, delete=False) as tmp:
        result = subprocess.run([*cmd, "-o", tmp.name], capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            os.unlink(tmp.name)
            raise BuildError(f"compiling the {variant} CPU kernels failed:\n{' '.join(cmd)}\n{result.stderr[-4000:]}")
        os.replace(tmp.name, target)
    for stale in out_dir.glob(f"libpagoda_cpu-{variant}-*.so"):
        if stale != target:
            stale.unlink(missing_ok=True)
    return target


def main() -> int:
    if os.environ.get("PAGODA_DISABLE_CPU_KERNELS"):
        print("pagoda: PAGODA_DISABLE_CPU_KERNELS is set; CPU kernels not built")
        return 0
    out_dir = default_build_dir()
    try:
        with ThreadPoolExecutor(len(VARIANTS)) as pool:
            built = list(pool.map(lambda v: build(v, out_dir), VARIANTS))
        for variant, path in zip(VARIANTS, built, strict=True):
            print(f"pagoda: CPU kernels ({variant}) -> {path}")
    except BuildError as exc:
        print(f"pagoda: {exc}", file=sys.stderr)
        return 1
    return 0
