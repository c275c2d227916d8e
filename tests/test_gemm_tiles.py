"""The GEMM's tile choice (cpu_kernels/gemm_tiles.py) from injected timings, and its override."""

from __future__ import annotations

import pytest

from pagoda.layers.cpu_kernels import gemm_tiles
from pagoda.layers.cpu_kernels.gemm_tiles import NEVER, decide, parse_forced

# rows -> (vdpbf16ps seconds, FMA seconds), shaped like the CPUs seen
INTEL_AVX512 = {4: (1.0, 0.96), 8: (1.0, 1.01), 16: (1.0, 0.94), 64: (1.0, 0.86)}
ZEN4 = {4: (1.0, 1.5), 8: (1.0, 1.3), 16: (1.0, 1.4), 64: (1.0, 1.7)}


def test_fma_from_the_smallest_count_that_wins_onwards() -> None:
    assert decide(INTEL_AVX512) == 16  # 16 and 64 win, 8 does not: 4 rows winning is not enough
    assert decide({**INTEL_AVX512, 8: (1.0, 0.9)}) == 8  # 4 rows within the margin
    assert decide({r: (1.0, 0.5) for r in INTEL_AVX512}) == 4


def test_vdpbf16ps_kept_where_fma_does_not_win_clearly() -> None:
    assert decide(ZEN4) == NEVER
    assert decide({**INTEL_AVX512, 64: (1.0, 0.97)}) == NEVER  # within the margin at the top


def test_forced_forms_and_a_clear_error() -> None:
    assert parse_forced("dpbf16") == NEVER and parse_forced("FMA") == 1 and parse_forced("fma:24") == 24
    for bad in ("amx", "fma:0", "fma:x", ""):
        with pytest.raises(ValueError, match="dpbf16, fma or fma:ROWS"):
            parse_forced(bad)


def test_forced_choice_skips_the_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gemm_tiles.ENV, "fma:8")
    got: list[int] = []

    def run(_x: object) -> None:
        raise AssertionError("measured despite the override")

    assert gemm_tiles.choose(got.append, run, 64) == 8 and got == [8]  # type: ignore[arg-type]


def test_measure_times_both_kinds_and_leaves_fma_off() -> None:
    calls: list[int] = []
    timings = gemm_tiles.measure(calls.append, lambda x: None, 16, repeats=1)  # type: ignore[arg-type]
    assert set(timings) == set(gemm_tiles.PROBE_ROWS) and calls[-1] == NEVER and {1, NEVER} <= set(calls)


def test_choice_cached_reused_and_remeasured_on_request(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gemm_tiles.ENV, raising=False)
    cache = tmp_path / "tiles.json"
    runs: list[int] = []
    set_rows: list[int] = []

    def run(x) -> None:  # noqa: ANN001
        runs.append(x.shape[0])

    first = gemm_tiles.choose(set_rows.append, run, 16, cache)  # type: ignore[arg-type]
    assert runs and cache.exists() and set_rows[-1] == first
    runs.clear()
    assert gemm_tiles.choose(set_rows.append, run, 16, cache) == first and not runs  # type: ignore[arg-type]
    cache.write_text("{not json")
    gemm_tiles.choose(set_rows.append, run, 16, cache)  # type: ignore[arg-type]
    assert runs  # a broken cache is measured again, not an error
    runs.clear()
    gemm_tiles.choose(set_rows.append, run, 16, cache, retune=True)  # type: ignore[arg-type]
    assert runs


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
