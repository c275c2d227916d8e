"""The kernel plan's decisions, from injected timings (so they are covered on any CPU)."""

from __future__ import annotations

import json

import pytest
import torch

from pagoda.layers import kernel_plan
from pagoda.layers.kernel_plan import BUCKETS, KernelPlan, ShapePlan, decide, measure, parse_forced


def flat(**per_row_cost: float) -> dict[str, dict[int, float]]:
    """Timings where each path costs a fixed overhead plus the given seconds per row."""
    return {p: {b: 1e-3 + c * b for b in BUCKETS} for p, c in per_row_cost.items()}


def curve(values: dict[str, list[float]]) -> dict[str, dict[int, float]]:
    return {p: dict(zip(BUCKETS, v, strict=True)) for p, v in values.items()}


# An AMX Xeon's shape of timings: the own kernels stream one row as fast as oneDNN, oneDNN's
# tiles win 2-6x from 16 rows (docs/performance.md).
AMX = curve({
    "gemv": [1.0, 1.1, 1.6, 2.6, 5.0, 10, 20, 40, 80],
    "gemm": [1.1, 1.1, 1.2, 1.3, 1.8, 3.0, 5.8, 11, 22],
    "onednn": [1.05, 1.05, 1.05, 1.1, 1.0, 1.1, 1.5, 2.5, 4.0],
    "torch": [2.0, 2.0, 2.0, 2.0, 2.0, 2.2, 2.6, 3.5, 5.0],
})
# Zen 4's: the own GEMM wins everywhere.
ZEN4 = curve({
    "gemv": [0.9, 1.05, 1.6, 2.6, 5.0, 10, 20, 40, 80],
    "gemm": [1.0, 1.0, 1.1, 1.2, 1.4, 2.2, 4.4, 8.8, 17],
    "onednn": [1.6, 1.6, 1.7, 1.8, 2.2, 3.3, 5.1, 9.9, 19],
    "torch": [3.0, 3.0, 3.0, 3.1, 3.3, 4.0, 6.0, 11, 21],
})


def test_amx_shape_takes_onednn_in_one_copy() -> None:
    plan = decide(AMX)
    assert plan.storages == {"onednn"}
    assert set(plan.paths) == {"onednn"}


def test_two_copies_mix_gemv_for_one_row_with_onednn() -> None:
    plan = decide(AMX, copies=2)
    assert plan.path_for(1) == "gemv"
    assert plan.path_for(300) == "onednn" and plan.path_for(16) == "onednn"
    assert plan.storages == {"plain", "onednn"}


def test_zen4_shape_takes_the_gemm_for_every_row_count() -> None:
    plan = decide(ZEN4)
    assert plan.paths == ("gemm",) * len(BUCKETS)
    assert plan.max_rows("gemm") > 10**9
    # one row is 10% faster by the GEMV, but a second copy of the weight is not worth that
    assert decide(ZEN4, copies=2).path_for(1) == "gemv"
    assert decide(ZEN4, copies=2).path_for(2) == "gemm"


def test_one_copy_prefers_the_storage_that_loses_least_overall() -> None:
    # plain storage: gemv fast for few rows, torch decent for many; panels: gemm slightly
    # slower than gemv at one row but much faster from 4 rows
    t = curve({
        "gemv": [1.0, 1.2, 2, 4, 8, 16, 32, 64, 128],
        "torch": [5.0, 5, 5, 5, 6, 8, 12, 20, 36],
        "gemm": [1.2, 1.2, 1.3, 1.5, 2, 3, 6, 12, 24],
    })
    plan = decide(t)
    assert plan.paths == ("gemm",) * len(BUCKETS)
    # within the plain storage, each bucket still takes its faster path
    only_plain = decide({k: v for k, v in t.items() if k != "gemm"})
    assert only_plain.path_for(1) == "gemv" and only_plain.path_for(256) == "torch"
    assert only_plain.max_rows("gemv") == 8 and only_plain.max_rows("gemm") == 0


def test_decide_refuses_incomplete_timings() -> None:
    with pytest.raises(ValueError, match="no timing for rows"):
        decide({"gemm": {2: 1.0}})
    with pytest.raises(ValueError, match="no timing for rows"):
        decide({"gemm": {1: 1.0, 4: 1.0}})
    with pytest.raises(ValueError, match="no linear path"):
        decide({})
    with pytest.raises(ValueError, match="1 or 2"):
        decide(ZEN4, copies=3)


def test_shape_plan_buckets_and_description() -> None:
    plan = ShapePlan(("gemv",) * 4 + ("gemm",) * 2 + ("onednn",) * 3)
    assert [plan.path_for(r) for r in (1, 8, 9, 32, 33, 10_000)] == ["gemv", "gemv", "gemm", "gemm", "onednn", "onednn"]
    assert plan.describe() == "rows 1-8 gemv, 9-32 gemm, 33+ onednn"
    assert plan.max_rows("gemv") == 8
    assert ShapePlan(("gemv",) + ("torch",) * 8).describe() == "rows 1 gemv, 2+ torch"
    with pytest.raises(ValueError, match="unknown linear paths"):
        ShapePlan(("amx",) * len(BUCKETS))
    with pytest.raises(ValueError, match="one path per bucket"):
        ShapePlan(("gemm",))


def test_forced_plans_parse_and_refuse_clearly() -> None:
    avail = ["gemv", "gemm", "torch"]
    assert parse_forced("1-8:gemv,9-32:gemm,33+:torch", avail).describe() == "rows 1-8 gemv, 9-32 gemm, 33+ torch"
    assert parse_forced("gemm", avail).paths == ("gemm",) * len(BUCKETS)
    assert parse_forced("1-2:gemv,3+:gemm", avail).path_for(3) == "gemm"
    with pytest.raises(ValueError, match=r"not available on this machine.*available: \['gemv', 'gemm', 'torch'\]"):
        parse_forced("1+:onednn", avail)
    with pytest.raises(ValueError, match="without gaps"):
        parse_forced("1-8:gemv,16+:gemm", avail)
    with pytest.raises(ValueError, match="not a bucket bound"):
        parse_forced("1-7:gemv,8+:gemm", avail)
    with pytest.raises(ValueError, match="is not 'A-B:path'"):
        parse_forced("one:gemv", avail)


def test_measure_times_each_path_and_drops_a_slow_one_early() -> None:
    calls: list[tuple[str, int]] = []

    def run(path: str, rows: int) -> float:
        calls.append((path, rows))
        return rows * (1.0 if path == "gemm" else 10.0)

    t = measure(run, ["gemm", "torch"], repeats=3)
    assert t["gemm"] == {b: float(b) for b in BUCKETS}
    # torch lost 10x at one row: timed there only (a warm-up, 3 passes and 3 more to confirm)
    assert [r for p, r in calls if p == "torch"] == [1] * 7 and t["torch"] == {1: 10.0}
    assert decide(t).paths == ("gemm",) * len(BUCKETS)
    # one disturbed median (a shared machine) is timed again and does not rule the path out
    slow_once = iter([50.0] * 3)  # the warm-up and two of the three passes
    t = measure(lambda p, r: next(slow_once, 1.0) if p == "gemm" else 2.0, ["gemm", "torch"], repeats=3)
    assert set(t["gemm"]) == set(BUCKETS) and t["gemm"][1] == 1.0
    # a path that lost early still wins a later bucket on the extrapolation only if it is faster there
    assert decide({"gemv": {1: 1.0, 2: 1.0}, "gemm": {b: 3.0 for b in BUCKETS}}).path_for(64) == "gemm"


def test_plan_round_trips_through_the_cache(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path))
    shape_plan = decide(AMX, copies=2)
    plan = KernelPlan({(960, 576): shape_plan, (49152, 576): ShapePlan(("gemm",) * len(BUCKETS))}, "measured",
                      "abc123", {(960, 576): AMX})
    where = kernel_plan.store(plan)
    assert where is not None and json.loads(where.read_text())["shapes"]["960x576"] == list(shape_plan.paths)
    again = kernel_plan.load_cached("abc123")
    assert again is not None and again.source == "cached"
    assert again.shapes == plan.shapes and again.timings[(960, 576)]["onednn"][16] == AMX["onednn"][16]
    assert "960x576: rows 1 gemv, 2+ onednn" in again.timing_table()
    assert again.summary() == "rows 1+ gemm"  # the biggest shape's plan
    (tmp_path / "kernel_plans" / "abc123.json").write_text("{not json")
    assert kernel_plan.load_cached("abc123") is None
    assert kernel_plan.load_cached("missing") is None


def test_key_changes_with_what_the_plan_depends_on() -> None:
    shapes = [((960, 576), 30)]
    base = kernel_plan.plan_key(shapes, "avx2", 2, 1)
    assert base == kernel_plan.plan_key(shapes, "avx2", 2, 1)
    assert len({base, kernel_plan.plan_key(shapes, "avx512bf16", 2, 1), kernel_plan.plan_key(shapes, "avx2", 1, 1),
                kernel_plan.plan_key(shapes, "avx2", 2, 2), kernel_plan.plan_key([((960, 576), 29)], "avx2", 2, 1)}) == 5


# ------------------------------------------------------------------ plans applied to layers


def _layers(gen: torch.Generator) -> torch.nn.ModuleList:
    from pagoda.layers.linear import Linear

    model = torch.nn.ModuleList([Linear(70, 45, bias=True), Linear(64, 96)]).to(torch.bfloat16)
    for layer in model:
        layer.weight.data.copy_(torch.randn(layer.weight.shape, generator=gen) / 8)
        if layer.bias is not None:
            layer.bias.data.copy_(torch.randn(layer.bias.shape, generator=gen))
    return model


@pytest.mark.parametrize("forced", ["gemv", "gemm", "onednn", "torch", "1-2:gemv,3-16:gemm,17+:torch"])
def test_each_path_of_a_plan_computes_the_product(forced: str) -> None:
    from pagoda.layers.kernel_tuning import available_paths
    from pagoda.layers.linear import prepack_for_cpu

    avail = available_paths()
    shape_plan = parse_forced(forced, kernel_plan.PATHS) if forced[0].isdigit() else ShapePlan((forced,) * len(BUCKETS))
    if not set(shape_plan.paths) <= set(avail):
        pytest.skip(f"{sorted(set(shape_plan.paths) - set(avail))} not on this machine")
    gen = torch.Generator().manual_seed(5)
    model = _layers(gen)
    plain = [layer.weight.detach().clone() for layer in model]
    plan = KernelPlan({(45, 70): shape_plan, (96, 64): shape_plan}, "forced")
    assert prepack_for_cpu(model, plan=plan) == 2
    for layer, w in zip(model, plain, strict=True):
        assert layer.method.plan == shape_plan
        assert (layer.method.gemm_weight is not None) == ("panels" in shape_plan.storages)
        assert (layer.method.packed is not None) == ("onednn" in shape_plan.storages)
        # the plain weight is freed where no path reads it
        assert bool(layer.weight.numel()) == ("plain" in shape_plan.storages)
        for m in (1, 2, 3, 16, 17, 40):
            x = torch.randn(m, w.shape[1], generator=gen).to(torch.bfloat16)
            b = layer.bias.float() if layer.bias is not None else None
            want = torch.nn.functional.linear(x.float(), w.float(), b)
            torch.testing.assert_close(layer(x).float(), want, atol=2e-2, rtol=2e-2)


def test_engine_measures_caches_logs_and_exports_its_plan(tiny_llama, tmp_path, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    from prometheus_client import CollectorRegistry, generate_latest

    from pagoda.config import EngineConfig
    from pagoda.engine_setup import build_model_parts
    from pagoda.layers import cpu_kernels
    from pagoda.metrics import PrometheusStatLogger

    if not cpu_kernels.available():
        pytest.skip("no CPU kernels here")

    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(kernel_plan.PLAN_ENV, raising=False)
    config = EngineConfig.from_kwargs(str(tiny_llama), dtype="bfloat16", num_kv_blocks=32)
    with caplog.at_level("INFO", logger="pagoda"):
        first = build_model_parts(config)
    assert first.info.kernel_plan_source == "measured" and first.info.linear_kernels.startswith("rows 1")
    assert first.info.decoder == "native stack"
    assert any(r.getMessage().startswith("linear (measured): rows 1") for r in caplog.records)
    assert len(list((tmp_path / "kernel_plans").glob("*.json"))) == 1
    second = build_model_parts(config)
    assert second.info.kernel_plan_source == "cached"
    assert second.info.linear_kernels == first.info.linear_kernels
    model = second.runner.model
    plans = {m.method.plan for m in model.modules() if getattr(getattr(m, "method", None), "plan", None) is not None}
    assert plans, "every bf16 linear carries its shape's plan"
    registry = CollectorRegistry()
    stat_logger = PrometheusStatLogger("tiny", config, registry=registry)
    stat_logger.record_engine_info(second.info)
    text = generate_latest(registry).decode()
    assert 'pagoda:kernel_plan_info{' in text and f'linear_kernels="{second.info.linear_kernels}"' in text
    assert 'decoder="native stack"' in text
    assert f'kernel_variant="{cpu_kernels.library().variant}"' in text  # type: ignore[union-attr]


def test_a_forced_plan_the_machine_cannot_run_is_a_clear_error(tiny_llama, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from pagoda.llm import LLM

    monkeypatch.setenv(kernel_plan.PLAN_ENV, "1+:amx_tiles")
    with pytest.raises(ValueError, match="amx_tiles.*not available on this machine"):
        LLM(str(tiny_llama), dtype="bfloat16", num_kv_blocks=32)
