"""Which tiles the bf16 GEMM runs, by row count, chosen by measurement at load.

The `avx512bf16` build has two tile kinds over the same packed panels: `vdpbf16ps` (a bf16 dot
product per k-pair) and fp32 FMAs on the weight widened in registers (two per k-pair). Which
is faster once the arithmetic binds depends on the CPU: vdpbf16ps issues at a quarter of the
FMA rate on an Intel Xeon seen here (avx512_fp16, no AMX exposed) and at the full rate on
Zen 4. So at load the library times both on a weight that stays in L2, at a few row counts,
and steps from the smallest count where the FMA tiles win at that count and every larger
one take them (`decide`); the choice is cached per CPU model and flags, kernel build and
threads (`pagoda tune` measures again). `PAGODA_GEMM_TILE` forces it: `dpbf16`, `fma`, or
`fma:ROWS`.
Other builds have one tile kind and ignore this.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

logger = logging.getLogger("pagoda")

ENV = "PAGODA_GEMM_TILE"
NEVER = 1 << 62
PROBE_ROWS = (4, 8, 16, 64)  # below 4 rows a step streams its weights: vdpbf16ps, fewer chains
PROBE_K = 1024  # a 512 x 1024 bf16 weight: 1 MiB, in L2
# NOTE: the FMA tiles must win by this much to be taken: near-equal timings keep vdpbf16ps
# (fewer instructions, and what the other kernels' numerics were checked against first).
MARGIN = 0.95


def decide(timings: Mapping[int, tuple[float, float]]) -> int:
    """The smallest probed row count from which the FMA tiles beat vdpbf16ps (by MARGIN) at it
    and at every larger probed count; NEVER when they do not win at the largest.
    `timings`: rows -> (vdpbf16ps seconds, FMA seconds)."""
    start = NEVER
    for rows in sorted(timings, reverse=True):
        dot, fma = timings[rows]
        if fma > MARGIN * dot:
            break
        start = rows
    return start


def parse_forced(value: str) -> int:
    """`dpbf16` -> NEVER, `fma` -> 1, `fma:ROWS` -> ROWS; ValueError naming the forms otherwise."""
    value = value.strip().lower()
    if value == "dpbf16":
        return NEVER
    if value == "fma":
        return 1
    if value.startswith("fma:") and value[4:].isdigit() and int(value[4:]) >= 1:
        return int(value[4:])
    raise ValueError(f"{ENV}={value!r}: expected dpbf16, fma or fma:ROWS (a row count from which the FMA tiles run)")


def measure(set_rows: Callable[[int], object], run: Callable[[torch.Tensor], object],
            k: int, repeats: int = 9) -> dict[int, tuple[float, float]]:
    """Best-of-`repeats` seconds of `run(x)` at each probed row count with vdpbf16ps and with the
    FMA tiles, alternating; leaves the FMA tiles off."""
    gen = torch.Generator().manual_seed(0)
    timings: dict[int, tuple[float, float]] = {}
    for rows in PROBE_ROWS:
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        best = [float("inf"), float("inf")]
        for _ in range(repeats):
            for kind, start in enumerate((NEVER, 1)):
                set_rows(start)
                run(x)
                t0 = time.perf_counter()
                run(x)
                best[kind] = min(best[kind], time.perf_counter() - t0)
        timings[rows] = (best[0], best[1])
    set_rows(NEVER)
    return timings


def choose(set_rows: Callable[[int], int], run: Callable[[torch.Tensor], object], k: int,
           cache: Path | None = None, retune: bool = False) -> int:
    """Sets and returns the row count from which the FMA tiles run: forced, else read from
    `cache` (unless `retune`), else measured and written there. The cache keeps one start's
    noise from flipping the choice (and with it the kernel plan's key) at the next."""
    forced = os.environ.get(ENV)
    if forced:
        rows = parse_forced(forced)
        set_rows(rows)
        logger.info("GEMM tiles (forced by %s): %s", ENV, describe(rows))
        return rows
    cached = None if retune or cache is None else _read(cache)
    if cached is not None:
        set_rows(cached)
        logger.info("GEMM tiles (cached): %s", describe(cached))
        return cached
    timings = measure(set_rows, run, k)
    rows = decide(timings)
    set_rows(rows)
    logger.info("GEMM tiles (measured): %s [FMA time / vdpbf16ps time: %s]", describe(rows), ", ".join(
        f"{r} rows {fma / dot:.2f}" for r, (dot, fma) in timings.items()))
    if cache is not None:
        _write(cache, rows, timings)
    return rows


def cache_path(identity: list[str]) -> Path:
    """Where the choice for `identity` (CPU model and flags, kernel build, threads) is kept."""
    from pagoda.layers.cpu_kernels import loader

    digest = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16]
    return loader.cache_root() / "gemm_tiles" / f"{digest}.json"


def _read(path: Path) -> int | None:
    try:
        rows = json.loads(path.read_text())["fma_rows"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("ignoring the cached GEMM tile choice %s (%s); measuring again", path, exc)
        return None
    return rows if isinstance(rows, int) and rows >= 1 else None


def _write(path: Path, rows: int, timings: Mapping[int, tuple[float, float]]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"fma_rows": rows, "timings": {str(r): t for r, t in timings.items()}}))
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("could not cache the GEMM tile choice in %s (%s)", path.parent, exc)


def describe(rows: int) -> str:
    if rows >= NEVER:
        return "vdpbf16ps at every row count"
    return "fp32 FMAs at every row count" if rows <= 1 else f"vdpbf16ps up to {rows - 1} rows, fp32 FMAs from {rows}"


__all__ = ["ENV", "NEVER", "cache_path", "choose", "decide", "describe", "measure", "parse_forced"]
