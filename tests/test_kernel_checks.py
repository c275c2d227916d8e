"""Checked kernel inputs (pagoda/layers/cpu_kernels/checks.py, `PAGODA_CHECK_KERNEL_INPUTS`).

Each index a kernel follows, corrupted on purpose, raises `KernelInputError` before the call.
An engine workload (the bf16 native stack, chunked prefill, prefix caching, preemption,
speculative verification, an fp8 pool) runs with every check on and gives the tokens it gives
unchecked. An engine bug that hands one request a slot past the pool fails that request
alone; the others finish as they would have.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.layers import cpu_kernels
from pagoda.layers.cpu_kernels import checks, ops
from pagoda.layers.cpu_kernels.checks import KernelInputError
from pagoda.llm import merge_delta
from pagoda.outputs import RequestOutput

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no CPU kernels")


@pytest.fixture
def checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checks, "ENABLED", True)


def attention_args() -> dict[str, torch.Tensor]:
    """One sequence of 20 tokens in blocks 3 and 5 of an 8-block pool, its last 4 rows queried."""
    gen = torch.Generator().manual_seed(0)
    return {"q": torch.randn(4, 4, 64, generator=gen).bfloat16(),
            "k": torch.randn(8, 16, 2, 64, generator=gen).bfloat16(),
            "v": torch.randn(8, 16, 2, 64, generator=gen).bfloat16(),
            "tables": torch.tensor([[3, 5]]), "seq_lens": torch.tensor([20]), "starts": torch.tensor([0, 4])}


def attend(a: dict[str, torch.Tensor]) -> torch.Tensor:
    return ops.paged_attention(a["q"], a["k"], a["v"], a["tables"], a["seq_lens"], a["starts"], 0.125)


def _set(name: str, index: tuple[int, ...], value: int) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda a: a[name].__setitem__(index, value)


@pytest.mark.parametrize(("corrupt", "message"), [
    (_set("tables", (0, 1), 8), "block_tables holds 8, outside"),
    (_set("tables", (0, 0), -1), "block_tables holds -1, outside"),
    (_set("seq_lens", (0,), 33), "seq_lens holds 33, outside"),
    (_set("starts", (1,), 5), "does not split 4 rows"),
    (_set("seq_lens", (0,), 3), "more query rows than context"),
    (lambda a: a.__setitem__("tables", a["tables"].int()), "contiguous int64"),
])
def test_paged_attention_refuses_indices_outside_the_pool(checked: None, corrupt, message: str) -> None:
    args = attention_args()
    assert attend(args).shape == (4, 256)  # the intact call passes its checks
    corrupt(args)
    with pytest.raises(KernelInputError, match=message):
        attend(args)


def test_slot_writes_and_rotary_refuse_indices_outside_their_buffers(checked: None) -> None:
    a = attention_args()
    k, v = a["k"][0, :3].clone(), a["v"][0, :3].clone()
    ops.reshape_and_cache(k, v, a["k"], a["v"], torch.tensor([0, -1, 127]))  # -1: skipped
    with pytest.raises(KernelInputError, match="slot_mapping holds 128"):
        ops.reshape_and_cache(k, v, a["k"], a["v"], torch.tensor([0, 128, 5]))
    with pytest.raises(KernelInputError, match="2 entries, the kernel reads 3"):
        ops.reshape_and_cache(k, v, a["k"], a["v"], torch.tensor([0, 1]))
    cos = torch.ones(32, 64)
    ops.rotary_inplace(a["q"], torch.tensor([0, 1, 2, 31]), cos, cos)
    with pytest.raises(KernelInputError, match="positions holds 32"):
        ops.rotary_inplace(a["q"], torch.tensor([0, 1, 32, 3]), cos, cos)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    shared = torch.randint(3, 49000, (40,), generator=gen).tolist()
    return [shared + torch.randint(3, 49000, (n,), generator=gen).tolist() for n in (3, 30, 61)] + [shared[:20]]


@pytest.mark.parametrize("engine", [
    {},
    {"kv_cache_dtype": "fp8"},
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}},
])
def test_engine_workload_passes_every_check(engine: dict, tiny_model_factory,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE: 14 blocks of 16 for four ~60-130-token sequences: preemption; a 48-token budget:
    # chunked prefill; the shared 40-token prefix: prefix-cache hits.
    llm = LLM(str(tiny_model_factory("llama")), dtype="bfloat16", num_kv_blocks=14, max_num_batched_tokens=48, max_model_len=200,
              enable_prefix_caching=True, **engine)
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0)
    unchecked = [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)]
    calls = {"paged": 0}
    paged = checks.paged

    def counting(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
        calls["paged"] += 1
        paged(*args, **kwargs)

    monkeypatch.setattr(checks, "ENABLED", True)
    monkeypatch.setattr(checks, "paged", counting)
    outs = llm.generate(prompts(), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == unchecked
    assert calls["paged"] >= 40  # every step's attention (or native stack) was checked
    assert sum(o.metrics.num_preemptions for o in outs if o.metrics) >= 1
    assert any(o.num_cached_tokens for o in outs)


def test_an_engine_bug_fails_its_request_alone(checked: None, tiny_model_factory,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A slot past the pool, given to one request (an engine bug), is caught before the write:
    that request fails with the check's message, the others get their own tokens."""
    llm = LLM(str(tiny_model_factory("llama")), dtype="bfloat16", num_kv_blocks=64)
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)
    good = prompts()[:2]
    expected = [o.outputs[0].token_ids for o in llm.generate(good, params, use_tqdm=False)]
    engine = llm.engine
    preparer = engine.runner.preparer
    slot = preparer._slot
    monkeypatch.setattr(preparer, "_slot", lambda r, pos: 1 << 40 if r.request_id == "bad" and pos > 20 else slot(r, pos))
    for i, prompt in enumerate(good):
        engine.add_request(f"good{i}", prompt, params)
    engine.add_request("bad", prompts()[2], params)
    results: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            results[delta.request_id] = merge_delta(results.get(delta.request_id), delta)
    engine.check_integrity()
    assert results["bad"].error is not None and "slot_mapping holds 1099511627776" in results["bad"].error
    assert [results[f"good{i}"].outputs[0].token_ids for i in range(2)] == expected
