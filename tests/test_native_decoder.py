"""The one-call native decoder stack (pagoda/models/native_decoder.py) against the layer path.

It runs the same kernels in the same order on the same buffers, so the bound is equality:
every final hidden state bit for bit, hence the same greedy tokens. The engine runs prompts of
mixed lengths (prefill steps and decode steps both through the native stack, whose paged
attention takes prefill chunks too), in bf16, under each weight scheme and KV cache dtype the stack takes, and with speculative
verification (several decode rows per sequence).
"""

from __future__ import annotations

import logging

import pytest
import torch

from pagoda.layers import cpu_kernels
from pagoda.llm import LLM
from pagoda.models.native_decoder import NativeDecoder
from pagoda.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not cpu_kernels.computes_bf16(),
                                reason="the native decoder stack needs a vectorized kernel build (avx512bf16, avx2)")
def quantized_panels() -> bool:
    return cpu_kernels.available() and cpu_kernels.ops.panels_are_native()


@pytest.fixture(autouse=True)
def gemm_plan(monkeypatch):  # type: ignore[no-untyped-def]
    """Every linear on the GEMM, whatever this CPU measures (the stack runs the GEMM only)."""
    monkeypatch.setenv("PAGODA_LINEAR_PLAN", "gemm")


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, 49000, (n,), generator=gen).tolist() for n in (5, 23, 40, 71)]


class Recorder:
    """Wraps the model's logits and native stack: the hidden states and the native calls."""

    def __init__(self, llm: LLM) -> None:
        self.runner = llm.engine.runner
        self.model = self.runner.model
        self.native = self.runner.native_decoder
        self.hidden: list[torch.Tensor] = []
        self.native_calls = 0
        self.native_rows = 0  # the widest step the stack ran
        logits = self.model.compute_logits
        self.model.compute_logits = lambda h: (self.hidden.append(h.clone()), logits(h))[1]

    def run(self, llm: LLM, native: bool) -> list[list[int]]:
        self.hidden.clear()
        self.native_calls = self.native_rows = 0
        if native:
            assert self.native is not None
            stack = self.native

            class Counting:
                def takes(inner, *args):  # noqa: N805
                    return stack.takes(*args)

                def __call__(inner, *args):  # noqa: N805
                    self.native_calls += 1
                    self.native_rows = max(self.native_rows, args[0].shape[0])
                    return stack(*args)

            self.runner.native_decoder = Counting()
        else:
            self.runner.native_decoder = None
        params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0)
        outs = llm.generate(prompts(), params)
        return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize(("arch", "engine"), [
    ("llama", {}),
    ("qwen2", {}),  # q/k/v bias, tied embeddings
    ("qwen3", {}),  # per-head q/k RMSNorm
    ("phi3", {}),  # q/k/v and gate/up fused in the checkpoint, a 24-token window
    ("mistral_swa", {}),  # sliding window of 16, contexts up to 95
    ("llama3", {"block_size": 8}),
    ("llama", {"quantization": "int8"}),
    ("llama", {"quantization": "int4"}),
    ("llama", {"kv_cache_dtype": "fp8"}),
    ("llama", {"kv_cache_dtype": "fp8_e5m2", "quantization": "int4"}),
    ("llama", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}}),
    ("gemma3", {}),  # q/k norms, Gemma norms, GeGLU, local (8-token window) and global layers, 256-wide heads
    ("gemma3_hd64", {"quantization": "int8"}),
    ("gemma3_w32", {"kv_cache_dtype": "fp8"}),  # hybrid KV groups: blocks leave the local layers' window
    ("mixtral", {}),  # every layer sparse: router, top-2 of 8 renormalized, experts on panels
    ("qwen3_moe", {}),  # a dense layer, then a sparse one (weights rounded to bf16, not renormalized)
    ("mixtral", {"quantization": "int8"}),  # quantized experts' packed weights
])
def test_native_stack_equals_the_layer_path(arch: str, engine: dict, tiny_model_factory) -> None:
    # NOTE: without quantized panels (the portable build) the stack multiplies the records
    # by the GEMV, for steps of up to 16 rows; wider steps (the first prefill) run the layers.
    records = "quantization" in engine and not quantized_panels()
    # NOTE: prefix caching off: the second run would compute only the prompts' uncached rows,
    # and a quantized GEMM rounds x by its row count (AMX tiles from the measured count take x as
    # it is, `vpdpbusd` below rounds it to int8 codes), so fewer rows may round differently.
    llm = LLM(str(tiny_model_factory(arch)), dtype="bfloat16", num_kv_blocks=128, enable_prefix_caching=False,
              **engine)
    rec = Recorder(llm)
    assert isinstance(rec.native, NativeDecoder)
    assert rec.native.max_rows == (16 if records else 1 << 62)
    native = rec.run(llm, native=True)
    native_hidden, calls, widest = list(rec.hidden), rec.native_calls, rec.native_rows
    layered = rec.run(llm, native=False)
    assert calls >= 20  # the decode steps ran natively
    if records:
        assert 4 <= widest <= 16  # the batched decode steps
    else:
        assert widest >= sum(len(p) for p in prompts())  # so did the step prefilling every prompt
    assert rec.native_calls == 0
    assert native == layered
    assert len(native_hidden) == len(rec.hidden)
    for a, b in zip(native_hidden, rec.hidden, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("arch", "engine", "why"), [
    ("llama", {"dtype": "float32"}, "layer 0: torch.float32 norms (the stack's are bf16)"),
])
def test_models_the_stack_does_not_take_run_their_layers(arch: str, engine: dict, why: str,
                                                          tiny_model_factory, caplog) -> None:
    """They run layer by layer, and the start-up log says why (`Decoder: ...`)."""
    with caplog.at_level(logging.INFO, logger="pagoda"):
        llm = LLM(str(tiny_model_factory(arch)), **{"dtype": "bfloat16", **engine})
    assert llm.engine.runner.native_decoder is None and llm.engine.runner.native_refusal == why
    assert f"Decoder: layer by layer in Python (no native stack: {why})" in caplog.text
    out = llm.generate([prompts()[1]], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4


def test_the_stack_takes_only_steps_its_plan_gives_the_gemm(tiny_model_factory, monkeypatch) -> None:
    """A plan with the GEMM up to 2 rows: the stack takes decode steps of 1-2 rows; wider steps
    run the layers (whose linears then take torch); the tokens equal an all-layer run."""
    monkeypatch.setenv("PAGODA_LINEAR_PLAN", "1-2:gemm,3+:torch")
    llm = LLM(str(tiny_model_factory("llama")), dtype="bfloat16", num_kv_blocks=128)
    rec = Recorder(llm)
    assert isinstance(rec.native, NativeDecoder) and rec.native.max_rows == 2
    gen = torch.Generator().manual_seed(4)
    batch = [torch.randint(3, 49000, (9,), generator=gen).tolist() for _ in range(3)]
    lengths = [6, 12, 24]  # steps of 3 rows, then 2, then 1

    def run(native: bool) -> list[list[int]]:
        rec.runner.native_decoder = rec.native if native else None
        outs = llm.generate(batch, [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in lengths])
        return [list(o.outputs[0].token_ids) for o in outs]

    calls: list[tuple[int, bool]] = []
    takes = rec.native.takes

    def recording(h, *args):  # type: ignore[no-untyped-def]
        calls.append((h.shape[0], takes(h, *args)))
        return calls[-1][1]

    rec.native.takes = recording  # type: ignore[method-assign]
    native = run(True)
    assert native == run(False)
    decode_rows = {rows: taken for rows, taken in calls if rows <= 3}
    assert decode_rows == {1: True, 2: True, 3: False}


def test_the_native_structs_match_their_ctypes_mirrors():
    """Issue 24: decoder.cpp's structs were mirrored by hand with no check; the library now
    reports their sizes and every mirror is checked at load (a stale build is a clear error)."""
    import ctypes

    from pagoda.layers import cpu_kernels
    from pagoda.layers.cpu_kernels.loader import AbiMismatchError
    from pagoda.models.native_decoder import ABI_MIRRORS

    lib = cpu_kernels.library()
    if lib is None:
        pytest.skip("no native kernels on this machine")
    lib.check_abi({"GemmWeight": cpu_kernels.ops.GemmWeight, **ABI_MIRRORS})
    assert set(lib.abi_sizes) == {"GemmWeight", *ABI_MIRRORS}

    class Stale(ctypes.Structure):
        _fields_ = [("num_tokens", ctypes.c_int64)]

    with pytest.raises(AbiMismatchError, match="DecodeStep: 8 bytes here.*rebuild"):
        lib.check_abi({"DecodeStep": Stale})
