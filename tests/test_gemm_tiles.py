"""The GEMM's tile choice (cpu_kernels/gemm_tiles.py) from injected timings, and its override."""

from __future__ import annotations

import json

import pytest

from pagoda.layers.cpu_kernels import gemm_tiles
from pagoda.layers.cpu_kernels.gemm_tiles import (
    NEVER,
    TileChoice,
    decide,
    decide_amx,
    decide_stream,
    describe,
    parse_forced,
    with_stream,
)

# rows -> (vdpbf16ps seconds, FMA seconds), shaped like the CPUs seen
INTEL_AVX512 = {4: (1.0, 0.96), 8: (1.0, 1.01), 16: (1.0, 0.94), 64: (1.0, 0.86)}
ZEN4 = {4: (1.0, 1.5), 8: (1.0, 1.3), 16: (1.0, 1.4), 64: (1.0, 1.7)}
# rows -> (vdpbf16ps, FMA, AMX seconds): the Intel Xeon with AMX seen on 2026-12-03 (its probe's ratios)
INTEL_AMX = {1: (1.0, 1.22, 0.94), 2: (1.0, 1.04, 0.78), 4: (1.0, 0.92, 0.53), 8: (1.0, 0.86, 0.35),
             16: (1.0, 0.88, 0.24), 64: (1.0, 1.0, 0.2)}


def test_fma_from_the_smallest_count_that_wins_onwards() -> None:
    assert decide(INTEL_AVX512) == 16  # 16 and 64 win, 8 does not: 4 rows winning is not enough
    assert decide({**INTEL_AVX512, 8: (1.0, 0.9)}) == 8  # 4 rows within the margin
    assert decide({r: (1.0, 0.5) for r in INTEL_AVX512}) == 4


def test_vdpbf16ps_kept_where_fma_does_not_win_clearly() -> None:
    assert decide(ZEN4) == NEVER
    assert decide({**INTEL_AVX512, 64: (1.0, 0.97)}) == NEVER  # within the margin at the top


def test_amx_from_the_smallest_count_that_beats_both_vector_tiles() -> None:
    assert decide_amx(INTEL_AMX) == TileChoice(NEVER, 1)
    slow_start = {**INTEL_AMX, 1: (1.0, 1.2, 1.3), 2: (1.0, 0.9, 0.88)}  # 2 rows: AMX within the margin of FMA
    assert decide_amx(slow_start) == TileChoice(amx_rows=4, fma_rows=2)  # FMA decided over 1-2 rows only
    assert decide_amx({**INTEL_AMX, 64: (1.0, 0.5, 0.49)}) == TileChoice(fma_rows=4)  # AMX loses at the top


def test_the_choice_described_as_the_kernel_runs_it() -> None:
    assert describe(TileChoice()) == "vdpbf16ps at every row count"
    assert describe(TileChoice(amx_rows=1)) == "AMX tiles at every row count"
    assert describe(TileChoice(8, 32)) == "vdpbf16ps up to 7 rows, fp32 FMAs 8-31 rows, AMX tiles from 32"
    assert describe(TileChoice(64, 16)) == "vdpbf16ps up to 15 rows, AMX tiles from 16"  # AMX is taken first
    assert describe(TileChoice(NEVER, 4, 32)) == ("vdpbf16ps up to 3 rows, AMX tiles from 4; "
                                                  "int8: vpdpbusd up to 31 rows, AMX tiles from 32")
    assert describe(TileChoice(NEVER, 4, 16, 8)).endswith("; int4: vpdpbusd up to 7 rows, AMX tiles from 8")
    # the avx2 build names its own two kinds
    assert describe(TileChoice(64), "avx2") == "FMAs widening in registers up to 63 rows, FMAs on widened chunks from 64"


def test_integer_amx_measured_beside_vpdpbusd_and_cached(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gemm_tiles.ENV, raising=False)
    # rows -> (vpdpbusd, AMX seconds): int8 AMX loses below 16 rows (widening the codes costs),
    # int4 below 8
    timings = {8: {1: (1.0, 2.0), 2: (1.0, 2.0), 4: (1.0, 1.5), 8: (1.0, 1.2), 16: (1.0, 0.6), 64: (1.0, 0.5)},
               4: {1: (1.0, 2.0), 2: (1.0, 1.5), 4: (1.0, 1.1), 8: (1.0, 0.8), 16: (1.0, 0.5), 64: (1.0, 0.4)}}
    measured: list[int] = []

    def measure_integer(apply, run, bits, k, repeats=9):  # noqa: ANN001, ANN202
        measured.append(bits)
        return timings[bits]

    monkeypatch.setattr(gemm_tiles, "measure_integer", measure_integer)
    applied: list[TileChoice] = []
    cache = tmp_path / "tiles.json"
    runs = {8: lambda x: None, 4: lambda x: None}
    choice = gemm_tiles.choose(applied.append, lambda x: None, 16, cache, amx=True, run_integer=runs)  # type: ignore[arg-type]
    assert (choice.amx_int8_rows, choice.amx_int4_rows) == (16, 8) and applied[-1] == choice and measured == [8, 4]
    assert json.loads(cache.read_text())["amx_int4_rows"] == 8
    measured.clear()
    assert gemm_tiles.choose(applied.append, lambda x: None, 16, cache, amx=True) == choice  # type: ignore[arg-type]
    assert not measured  # cached
    timings[8][64] = (1.0, 0.97)  # within the margin at the top: never
    assert gemm_tiles.choose(applied.append, lambda x: None, 16, cache, retune=True, amx=True,  # type: ignore[arg-type]
                             run_integer=runs).amx_int8_rows == NEVER
    # a cached AMX choice from before integer panels had AMX tiles is measured again
    cache.write_text('{"fma_rows": 4611686018427387904, "amx_rows": 1, "amx_int8_rows": 16}')
    measured.clear()
    gemm_tiles.choose(applied.append, lambda x: None, 16, cache, amx=True, run_integer=runs)  # type: ignore[arg-type]
    assert measured


# rows -> (the L2 probe's choice, the vector tiles prefetching) seconds on a streamed weight: the
# Intel AMX CPU of 2026-12-03 (AMX at one row read 15.4 GB/s, the prefetching vector tiles 17.8;
# at 8 rows AMX's arithmetic wins), and a Zen 4 whose hardware prefetcher keeps pace alone
STREAM_INTEL_AMX = {1: (1.0, 0.87), 2: (1.0, 0.9), 4: (1.0, 0.86), 8: (1.0, 1.4)}
STREAM_ZEN4 = {1: (1.0, 1.02), 2: (1.0, 1.05), 4: (1.0, 0.99), 8: (1.0, 1.0)}


def test_streamed_steps_go_to_the_prefetching_vector_tiles_below_the_first_count_they_lose() -> None:
    assert decide_stream(STREAM_INTEL_AMX) == 8
    assert decide_stream(STREAM_ZEN4) == 1  # no win at one row: nothing changes
    assert decide_stream({**STREAM_INTEL_AMX, 2: (1.0, 0.97)}) == 2  # within the margin at 2 rows
    assert decide_stream({r: (1.0, 0.5) for r in STREAM_INTEL_AMX}) == 16  # wins everywhere probed
    amx = TileChoice(amx_rows=1, amx_int8_rows=16)
    assert with_stream(amx, 8) == TileChoice(amx_rows=8, amx_int8_rows=16, prefetch_rows=1)
    assert with_stream(amx, 1) == amx
    assert with_stream(TileChoice(amx_rows=32), 8) == TileChoice(amx_rows=32, prefetch_rows=1)  # AMX never earlier
    assert with_stream(TileChoice(), 4) == TileChoice(prefetch_rows=1)  # no AMX: prefetching only
    assert describe(with_stream(amx, 8)) == ("vdpbf16ps up to 7 rows, AMX tiles from 8; one vector tile prefetches "
                                             "from 1 row; int8: vpdpbusd up to 15 rows, AMX tiles from 16")


def test_the_stream_probe_times_both_kinds_and_its_choice_is_cached(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gemm_tiles.ENV, raising=False)
    applied: list[TileChoice] = []
    streamed: list[tuple[int, TileChoice]] = []

    def run_stream(x) -> None:  # noqa: ANN001
        streamed.append((x.shape[0], applied[-1]))

    monkeypatch.setattr(gemm_tiles, "decide_stream", lambda timings: 4 if set(timings) == set(
        gemm_tiles.STREAM_PROBE_ROWS) else 1)
    cache = tmp_path / "tiles.json"
    choice = gemm_tiles.choose(applied.append, lambda x: None, 16, cache, run_stream=run_stream)  # type: ignore[arg-type]
    assert {rows for rows, _ in streamed} == set(gemm_tiles.STREAM_PROBE_ROWS)
    assert {kind.prefetch_rows for _, kind in streamed} == {gemm_tiles.DEFAULT_PREFETCH_ROWS, 1}
    assert choice.prefetch_rows == 1 and applied[-1] == choice
    assert json.loads(cache.read_text())["prefetch_rows"] == 1
    streamed.clear()
    assert gemm_tiles.choose(applied.append, lambda x: None, 16, cache, run_stream=run_stream) == choice  # type: ignore[arg-type]
    assert not streamed  # cached
    # a choice cached before the stream probe existed is measured again
    cache.write_text('{"fma_rows": 4611686018427387904, "amx_rows": 4611686018427387904}')
    gemm_tiles.choose(applied.append, lambda x: None, 16, cache, run_stream=run_stream)  # type: ignore[arg-type]
    assert streamed


def test_forced_forms_and_a_clear_error() -> None:
    assert parse_forced("dpbf16") == TileChoice() and parse_forced("FMA") == TileChoice(fma_rows=1)
    assert parse_forced("fma:24") == TileChoice(fma_rows=24)
    assert parse_forced("amx:4") == TileChoice(amx_rows=4, amx_int8_rows=4, amx_int4_rows=4)  # every kind alike
    assert parse_forced("amx") == TileChoice(amx_rows=1, amx_int8_rows=1, amx_int4_rows=1)
    for bad in ("amx:0", "fma:0", "fma:x", "dpbf16:3", "tiles", ""):
        with pytest.raises(ValueError, match="dpbf16, fma, fma:ROWS, amx or amx:ROWS"):
            parse_forced(bad)


def test_forced_choice_skips_the_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gemm_tiles.ENV, "fma:8")
    got: list[TileChoice] = []

    def run(_x: object) -> None:
        raise AssertionError("measured despite the override")

    assert gemm_tiles.choose(got.append, run, 64) == TileChoice(fma_rows=8) and got == [TileChoice(fma_rows=8)]


def test_avx2_build_chooses_its_widened_chunks_by_the_same_rule(monkeypatch: pytest.MonkeyPatch, caplog) -> None:  # noqa: ANN001
    # the widened chunks losing below 64 rows and winning there, as on the Zen 3 seen on 2026-12-03
    # (gemm_ab.py; wider gaps here, timed by sleeps): they take the steps from 64 rows, and the log
    # names them
    monkeypatch.delenv(gemm_tiles.ENV, raising=False)
    zen3 = {8: 1.4, 16: 1.2, 64: 0.6, 256: 0.6}
    assert decide({64: (1.0, 0.97), 256: (1.0, 0.96)}, gemm_tiles.BUILDS["avx2"].margin) == 64  # no margin there
    assert decide({64: (1.0, 0.97), 256: (1.0, 0.96)}) == NEVER
    state = {"fma": NEVER}

    def apply(choice: TileChoice) -> None:
        state["fma"] = choice.fma_rows

    def run(x) -> None:  # noqa: ANN001
        import time
        rows = x.shape[0]
        time.sleep(0.002 * (zen3[rows] if state["fma"] <= rows else 1.0))

    with caplog.at_level("INFO", logger="pagoda"):
        choice = gemm_tiles.choose(apply, run, 16, variant="avx2")  # type: ignore[arg-type]
    assert choice.fma_rows == 64 and state["fma"] == 64
    assert "FMAs on widened chunks from 64" in caplog.text and "vdpbf16ps" not in caplog.text


def test_measure_times_each_kind_and_leaves_vdpbf16ps_on() -> None:
    calls: list[TileChoice] = []
    timings = gemm_tiles.measure(calls.append, lambda x: None, 16, repeats=1)  # type: ignore[arg-type]
    assert set(timings) == set(gemm_tiles.PROBE_ROWS) and calls[-1] == TileChoice()
    assert set(calls) == {TileChoice(), TileChoice(fma_rows=1)} and all(len(t) == 2 for t in timings.values())
    calls.clear()
    timings = gemm_tiles.measure(calls.append, lambda x: None, 16, repeats=1, amx=True)  # type: ignore[arg-type]
    assert set(timings) == set(gemm_tiles.AMX_PROBE_ROWS) and TileChoice(amx_rows=1) in calls
    assert calls[-1] == TileChoice() and all(len(t) == 3 for t in timings.values())
    calls.clear()
    timings = gemm_tiles.measure_integer(calls.append, lambda x: None, 4, 16, repeats=1)  # type: ignore[arg-type]
    assert set(calls) == {TileChoice(), TileChoice(amx_int4_rows=1)} and calls[-1] == TileChoice()
    assert set(timings) == set(gemm_tiles.AMX_PROBE_ROWS) and all(len(t) == 2 for t in timings.values())


def test_choice_cached_reused_and_remeasured_on_request(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gemm_tiles.ENV, raising=False)
    cache = tmp_path / "tiles.json"
    runs: list[int] = []
    set_rows: list[TileChoice] = []

    def run(x) -> None:  # noqa: ANN001
        runs.append(x.shape[0])

    first = gemm_tiles.choose(set_rows.append, run, 16, cache, amx=True)  # type: ignore[arg-type]
    assert runs and cache.exists() and set_rows[-1] == first and 1 in runs  # AMX probed from one row
    runs.clear()
    assert gemm_tiles.choose(set_rows.append, run, 16, cache, amx=True) == first and not runs  # type: ignore[arg-type]
    cache.write_text("{not json")
    gemm_tiles.choose(set_rows.append, run, 16, cache)  # type: ignore[arg-type]
    assert runs  # a broken cache is measured again, not an error
    runs.clear()
    gemm_tiles.choose(set_rows.append, run, 16, cache, retune=True)  # type: ignore[arg-type]
    assert runs
    # a cached AMX choice where this process has no AMX (Linux refused the tile data) is measured again
    cache.write_text('{"fma_rows": 4611686018427387904, "amx_rows": 1}')
    runs.clear()
    assert gemm_tiles.choose(set_rows.append, run, 16, cache).amx_rows == NEVER and runs  # type: ignore[arg-type]


def test_loading_the_kernels_leaves_torchs_random_state_alone(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from pagoda.layers import cpu_kernels

    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path))  # nothing cached: the probe measures
    monkeypatch.delenv(gemm_tiles.ENV, raising=False)
    torch.manual_seed(1)
    want = torch.rand(4)
    torch.manual_seed(1)
    cpu_kernels.use_variant(None)
    assert torch.equal(torch.rand(4), want)
