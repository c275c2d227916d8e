"""Which tiles the bf16 GEMM runs, by row count, chosen by measurement at load.

The `avx512bf16` build has two tile kinds over the same packed panels: `vdpbf16ps` (a bf16 dot
product per k-pair) and fp32 FMAs on the weight widened in registers (two per k-pair). Which
is faster once the arithmetic binds depends on the CPU: vdpbf16ps issues at a quarter of the
FMA rate on an Intel Xeon seen here (avx512_fp16, no AMX exposed) and at the full rate on
Zen 4. So at load the library times both on a weight that stays in L2, at a few row counts,
and steps from the smallest count where the FMA tiles win at that count and every larger
one take them (`decide`); the choice is cached per CPU model and flags, kernel build and
threads (`pagoda tune` measures again). On CPUs with AMX (and Linux granting the tile data)
the same panels also multiply on the tile units (gemm.cpp's `amx_pass`), a third kind timed
alongside from one row: steps from the smallest probed count where AMX beats the better vector
tile at that count and every larger one take it (`decide_amx`), the vector kinds below.
int8 and int4 panels likewise: their `vpdpbusd` tiles against AMX on the weight widened to
bf16 (gemm.cpp's `AmxInt8`, `AmxInt4`), each timed on a weight of its kind and the same shape,
AMX from the smallest count where it wins at that count and every larger one.
A step of a few rows streams its weights from memory, which the L2 probe does not see: a
second probe times the choice against the vector tiles with prefetching (from one row) on a
weight larger than the caches, at 1-8 rows, and gives the rows below the first count where
they stop winning to them (`decide_stream`): on the Intel AMX CPU a one-row pass read 17.8 GB/s
so against AMX's 15.4 (docs/performance.md), on Zen 4 the hardware prefetcher alone kept pace.
The `avx2` build has two kinds as well, chosen the same way (`decide`, then the stream probe):
tiles that widen the weight in registers as they read it, and, from the chosen row count, each
chunk of a panel widened to fp32 once for 6-row FMA tiles (gemm.cpp's `avx2_wide_panel`; its
"FMA tiles" here, `TileChoice.fma_rows`).
`PAGODA_GEMM_TILE` forces it: `dpbf16`, `fma`, `fma:ROWS`, `amx` or `amx:ROWS` (AMX from ROWS,
every kind alike, vdpbf16ps and vpdpbusd below; on the avx2 build `dpbf16` names its register
tiles). The portable build has one tile kind and ignores this.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pagoda.layers.cpu_kernels.ops import DEFAULT_PREFETCH_ROWS

logger = logging.getLogger("pagoda")

ENV = "PAGODA_GEMM_TILE"
NEVER = 1 << 62
PROBE_ROWS = (4, 8, 16, 64)  # below 4 rows a step streams its weights: vdpbf16ps, fewer chains
AMX_PROBE_ROWS = (1, 2, 4, 8, 16, 64)  # AMX is timed from one row: it may win there too
PROBE_K = 1024  # a 512 x 1024 bf16 weight: 1 MiB, in L2
STREAM_PROBE_ROWS = (1, 2, 4, 8)  # the stream probe's row counts (steps that read their weights from memory)
STREAM_PROBE_SHAPE = (24576, 2048)  # its weight: 96 MiB of bf16, larger than the caches of the CPUs seen
# NOTE: the FMA tiles must win by this much to be taken: near-equal timings keep vdpbf16ps
# (fewer instructions, and what the other kernels' numerics were checked against first).
MARGIN = 0.95


@dataclass(frozen=True)
class BuildTiles:
    """How a kernel build's two bf16 tile kinds are named (log lines, `pagoda tune`), probed and
    decided between."""

    names: tuple[str, str]
    margin: float = MARGIN
    probe_rows: tuple[int, ...] = PROBE_ROWS


# The builds with two bf16 tile kinds. NOTE: the avx2 build's add the same products in the same
# order (bit-equal outputs, tests/test_cpu_kernels.py), so the faster is taken at no margin; its
# widened chunks win only where arithmetic binds hard (Zen 3, SmolLM2's linears: 0.95-1.00x the
# register tiles' time at 64 rows, 0.90-0.91x at 256-512), so its probe reaches prefill's rows.
BUILDS = {"avx512bf16": BuildTiles(("vdpbf16ps", "fp32 FMAs")),
          "avx2": BuildTiles(("FMAs widening in registers", "FMAs on widened chunks"), 1.0, (8, 16, 64, 256))}


@dataclass(frozen=True)
class TileChoice:
    """Row counts from which the bf16 GEMM takes the FMA tiles and the AMX tiles, and the int8
    and int4 GEMMs the AMX tiles (NEVER: not at all), and from which one tile prefetches."""

    fma_rows: int = NEVER
    amx_rows: int = NEVER
    amx_int8_rows: int = NEVER
    amx_int4_rows: int = NEVER
    prefetch_rows: int = DEFAULT_PREFETCH_ROWS  # one tile of this many rows or more prefetches

    def integer_rows(self, bits: int) -> int:
        return self.amx_int8_rows if bits == 8 else self.amx_int4_rows


def _wins_from(pairs: Mapping[int, tuple[float, float]], margin: float = MARGIN) -> int:
    """The smallest row count from which the second time beats the first (by `margin`) at it and
    at every larger count; NEVER when it does not win at the largest."""
    start = NEVER
    for rows in sorted(pairs, reverse=True):
        old, new = pairs[rows]
        if new > margin * old:
            break
        start = rows
    return start


def decide(timings: Mapping[int, tuple[float, float]], margin: float = MARGIN) -> int:
    """The smallest probed row count from which the FMA tiles beat vdpbf16ps (by `margin`) at it
    and at every larger probed count; NEVER when they do not win at the largest.
    `timings`: rows -> (vdpbf16ps seconds, FMA seconds)."""
    return _wins_from(timings, margin)


def decide_amx(timings: Mapping[int, tuple[float, float, float]]) -> TileChoice:
    """AMX from the smallest probed count where it beats the better vector tile (by MARGIN) at
    that count and every larger one; the FMA tiles decided over the counts below.
    `timings`: rows -> (vdpbf16ps, FMA, AMX seconds)."""
    amx = _wins_from({r: (min(dot, fma), a) for r, (dot, fma, a) in timings.items()})
    fma = _wins_from({r: (dot, f) for r, (dot, f, _) in timings.items() if r < amx})
    return TileChoice(fma, amx)


def decide_stream(timings: Mapping[int, tuple[float, float]]) -> int:
    """The smallest probed row count at which the vector tiles with prefetching no longer beat
    the choice (by MARGIN) on a streamed weight, counting up from the first; twice the largest
    probe where they win at every one. `timings`: rows -> (the choice's, the vector tiles with
    prefetching seconds)."""
    for rows in sorted(timings):
        old, new = timings[rows]
        if new > MARGIN * old:
            return rows
    return 2 * max(timings)


def with_stream(choice: TileChoice, stream_rows: int) -> TileChoice:
    """`choice` with steps below `stream_rows` on the vector tiles, prefetching (`decide_stream`)."""
    if stream_rows <= 1:
        return choice
    return replace(choice, prefetch_rows=1, amx_rows=max(choice.amx_rows, stream_rows))


def parse_forced(value: str) -> TileChoice:
    """`dpbf16`, `fma`, `fma:ROWS`, `amx` or `amx:ROWS` as a TileChoice; ValueError naming the forms otherwise."""
    kind, colon, rows = value.strip().lower().partition(":")
    if kind == "dpbf16" and not colon:
        return TileChoice()
    if kind in ("fma", "amx") and (not colon or rows.isdigit() and int(rows) >= 1):
        start = int(rows) if colon else 1
        return TileChoice(fma_rows=start) if kind == "fma" else TileChoice(amx_rows=start, amx_int8_rows=start, amx_int4_rows=start)
    raise ValueError(f"{ENV}={value!r}: expected dpbf16, fma, fma:ROWS, amx or amx:ROWS (a row count from which "
                     "those tiles run)")


def measure(apply: Callable[[TileChoice], object], run: Callable[[torch.Tensor], object],
            k: int, repeats: int = 9, amx: bool = False, counts: tuple[int, ...] = PROBE_ROWS) -> dict[int, tuple[float, ...]]:
    """Best-of-`repeats` seconds of `run(x)` at each probed row count (`counts`; AMX_PROBE_ROWS
    with `amx`) with vdpbf16ps, with the FMA tiles and (`amx`) with the AMX tiles, alternating;
    leaves vdpbf16ps on."""
    kinds = [TileChoice(), TileChoice(fma_rows=1)] + ([TileChoice(amx_rows=1)] if amx else [])
    return _best_times(apply, run, kinds, AMX_PROBE_ROWS if amx else counts, k, repeats)


def measure_integer(apply: Callable[[TileChoice], object], run: Callable[[torch.Tensor], object], bits: int,
                    k: int, repeats: int = 9) -> dict[int, tuple[float, ...]]:
    """Likewise for `run` (a product with int8 or int4 panels, `bits`) on vpdpbusd and on AMX tiles."""
    amx = TileChoice(amx_int8_rows=1) if bits == 8 else TileChoice(amx_int4_rows=1)
    return _best_times(apply, run, [TileChoice(), amx], AMX_PROBE_ROWS, k, repeats)


def _best_times(apply: Callable[[TileChoice], object], run: Callable[[torch.Tensor], object],
                kinds: list[TileChoice], counts: tuple[int, ...], k: int, repeats: int) -> dict[int, tuple[float, ...]]:
    gen = torch.Generator().manual_seed(0)
    timings: dict[int, tuple[float, ...]] = {}
    for rows in counts:
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        best = [float("inf")] * len(kinds)
        for _ in range(repeats):
            for index, kind in enumerate(kinds):
                apply(kind)
                run(x)
                t0 = time.perf_counter()
                run(x)
                best[index] = min(best[index], time.perf_counter() - t0)
        timings[rows] = tuple(best)
    apply(TileChoice())
    return timings


def choose(apply: Callable[[TileChoice], object], run: Callable[[torch.Tensor], object], k: int,
           cache: Path | None = None, retune: bool = False, amx: bool = False,
           run_integer: Mapping[int, Callable[[torch.Tensor], object]] | None = None,
           run_stream: Callable[[torch.Tensor], object] | None = None,
           variant: str = "avx512bf16") -> TileChoice:
    """Applies and returns the tile choice: forced, else read from `cache` (unless `retune`),
    else measured (AMX too where `amx`; for int8 and int4 panels too, by `run_integer[bits]`;
    the few-row steps on a streamed weight by `run_stream`, of STREAM_PROBE_SHAPE) and written there. The cache keeps one start's noise from flipping the choice (and with it the
    kernel plan's key) at the next."""
    forced = os.environ.get(ENV)
    if forced:
        choice = parse_forced(forced)
        apply(choice)
        logger.info("GEMM tiles (forced by %s): %s", ENV, describe(choice, variant))
        return choice
    cached = None if retune or cache is None else _read(cache)
    if cached is not None and min(cached.amx_rows, cached.amx_int8_rows, cached.amx_int4_rows) < NEVER and not amx:
        # NOTE: the key holds the CPU's flags, not the kernel's: Linux may refuse the tile data now
        logger.warning("the cached GEMM tile choice %s takes AMX tiles, which this process was not granted; "
                       "measuring again", cache)
        cached = None
    if cached is not None:
        apply(cached)
        logger.info("GEMM tiles (cached): %s", describe(cached, variant))
        return cached
    build = BUILDS[variant]
    timings = measure(apply, run, k, amx=amx, counts=build.probe_rows)
    choice = decide_amx(timings) if amx else TileChoice(fma_rows=decide(timings, build.margin))  # type: ignore[arg-type]
    integer = {bits: measure_integer(apply, run_bits, bits, k) for bits, run_bits in (run_integer or {}).items()
               if amx}
    for bits, times in integer.items():
        starts = _wins_from(times)  # type: ignore[arg-type]
        choice = replace(choice, **{"amx_int8_rows" if bits == 8 else "amx_int4_rows": starts})
    stream: dict[int, tuple[float, ...]] = {}
    if run_stream is not None:
        prefetching = replace(choice, amx_rows=NEVER, prefetch_rows=1)
        stream = _best_times(apply, run_stream, [choice, prefetching], STREAM_PROBE_ROWS, STREAM_PROBE_SHAPE[1], 7)
        choice = with_stream(choice, decide_stream(stream))  # type: ignore[arg-type]
    apply(choice)
    logger.info("GEMM tiles (measured): %s [time / %s time, %s%s: %s%s%s]", describe(choice, variant), *build.names, " and AMX" if amx else "", _ratios(timings),
                "".join(f"; int{bits}, AMX / vpdpbusd: {_ratios(times)}" for bits, times in integer.items()),
                f"; streamed, vector tiles prefetching / the choice: {_ratios(stream)}" if stream else "")
    if cache is not None:
        _write(cache, choice, timings)
    return choice


def _ratios(timings: Mapping[int, tuple[float, ...]]) -> str:
    return ", ".join(f"{r} rows " + " ".join(f"{t / ts[0]:.2f}" for t in ts[1:]) for r, ts in timings.items())


def cache_path(identity: list[str]) -> Path:
    """Where the choice for `identity` (CPU model and flags, kernel build, threads) is kept."""
    from pagoda.layers.cpu_kernels import loader

    digest = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16]
    return loader.cache_root() / "gemm_tiles" / f"{digest}.json"


def _read(path: Path) -> TileChoice | None:
    try:
        data = json.loads(path.read_text())
        # NOTE: a choice made before integer panels had AMX tiles (no "amx_int4_rows" beside an
        # AMX choice) is measured again, so that this CPU's int8 and int4 steps get them
        if data.get("amx_rows", NEVER) < NEVER and "amx_int4_rows" not in data:
            return None
        # NOTE: likewise a choice made before the stream probe (no "prefetch_rows")
        if "prefetch_rows" not in data:
            return None
        choice = TileChoice(data["fma_rows"], data.get("amx_rows", NEVER), data.get("amx_int8_rows", NEVER),
                            data.get("amx_int4_rows", NEVER), data["prefetch_rows"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("ignoring the cached GEMM tile choice %s (%s); measuring again", path, exc)
        return None
    valid = all(isinstance(r, int) and r >= 1 for r in (choice.fma_rows, choice.amx_rows, choice.amx_int8_rows,
                                                        choice.amx_int4_rows, choice.prefetch_rows))
    return choice if valid else None


def _write(path: Path, choice: TileChoice, timings: Mapping[int, tuple[float, ...]]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"fma_rows": choice.fma_rows, "amx_rows": choice.amx_rows,
                                   "amx_int8_rows": choice.amx_int8_rows, "amx_int4_rows": choice.amx_int4_rows,
                                   "prefetch_rows": choice.prefetch_rows,
                                   "timings": {str(r): t for r, t in timings.items()}}))
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("could not cache the GEMM tile choice in %s (%s)", path.parent, exc)


def describe(choice: TileChoice, variant: str = "avx512bf16") -> str:
    """E.g. "vdpbf16ps up to 3 rows, AMX tiles from 4" (AMX taken first, then the FMA tiles, as
    gemm.cpp does), then "; int8: vpdpbusd up to 15 rows, AMX tiles from 16" (and int4) where AMX
    takes integer panels; the kinds named as `variant`'s build calls them (BUILDS)."""
    first, second = BUILDS[variant].names
    bf16 = _spans([(first, 1), (second, min(choice.fma_rows, choice.amx_rows)), ("AMX tiles", choice.amx_rows)])
    if choice.prefetch_rows != DEFAULT_PREFETCH_ROWS:
        bf16 += f"; one vector tile prefetches from {choice.prefetch_rows} row{'s' if choice.prefetch_rows > 1 else ''}"
    return bf16 + "".join(f"; int{bits}: {_spans([('vpdpbusd', 1), ('AMX tiles', choice.integer_rows(bits))])}"
                          for bits in (8, 4) if choice.integer_rows(bits) < NEVER)


def _spans(starts: list[tuple[str, int]]) -> str:
    """Tile kinds by the row count from which each runs (each until the next one's start)."""
    ends = [start for _, start in starts[1:]] + [NEVER]
    spans = [(name, start, end) for (name, start), end in zip(starts, ends, strict=True) if start < end]
    if len(spans) == 1:
        return f"{spans[0][0]} at every row count"
    return ", ".join(f"{name} up to {end - 1} rows" if start == 1 else f"{name} from {start}" if end >= NEVER
                     else f"{name} {start}-{end - 1} rows" for name, start, end in spans)


__all__ = ["AMX_PROBE_ROWS", "BUILDS", "DEFAULT_PREFETCH_ROWS", "BuildTiles", "ENV", "NEVER", "STREAM_PROBE_ROWS", "STREAM_PROBE_SHAPE",
           "TileChoice", "cache_path", "choose", "decide", "decide_amx", "decide_stream", "describe", "measure",
           "measure_integer", "parse_forced", "with_stream"]
