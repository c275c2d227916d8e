"""Mixture-of-experts: Mixtral and Qwen3-MoE against transformers, and the `FusedMoE` layer
against a per-token loop (tests/conftest.py: "mixtral", top-2 of 8 experts renormalized in
both layers; "qwen3_moe", a dense layer then a sparse one, top-2 of 8 not renormalized)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_hf_equivalence import _prompts, hf_greedy, pagoda_greedy
from torch import nn

from pagoda import LLM, SamplingParams
from pagoda.distributed.group import SINGLE, ParallelGroup
from pagoda.layers import cpu_kernels
from pagoda.layers.fused_moe import FusedMoE, expert_target, pack_experts_for_cpu
from pagoda.layers.quantization import quantize_model

MAX_TOKENS = 12
E, K, H, FF = 8, 2, 64, 64  # experts, top-k, hidden, each expert's intermediate size


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_greedy_matches_hf(arch, tiny_model_factory):
    model_dir = tiny_model_factory(arch)
    want = hf_greedy(model_dir, _prompts(3), MAX_TOKENS)
    assert all(len(set(out)) > 4 for out in want), want  # NOTE: a model repeating a token hides bugs
    assert pagoda_greedy(model_dir, _prompts(3), MAX_TOKENS, num_kv_blocks=64, max_num_batched_tokens=32) == want


def _experts(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert checkpoint tensors: gate+up [E, 2I, H] and down [E, H, FF]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * FF, H, generator=g) * 0.3, torch.randn(E, H, FF, generator=g) * 0.3


def _fused(w13: torch.Tensor, w2: torch.Tensor, renormalize: bool, in_dtype: bool = False,
           tp: ParallelGroup = SINGLE) -> FusedMoE:
    """A `FusedMoE` loaded as the model loader loads it: each expert's tensors by name."""
    moe = FusedMoE(E, K, H, FF, renormalize, in_dtype, tp)
    params = dict(moe.named_parameters())
    for e in range(E):
        for proj, tensor in (("w1", w13[e, :FF]), ("w3", w13[e, FF:]), ("w2", w2[e])):
            target, shard = expert_target(f"layers.0.mlp.experts.{e}.{proj}.weight") or ("", (0, 0))
            param = params[target.removeprefix("layers.0.mlp.experts.")]
            param.weight_loader(param, tensor, shard)  # type: ignore[attr-defined]
    return moe


def _per_token(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
               renormalize: bool) -> torch.Tensor:
    """The reference: each token alone through its top-k experts."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = logits[t].float().softmax(-1)
        weights, ids = probs.topk(K)
        if renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights, ids.tolist(), strict=True):
            gate, up = (x[t] @ w13[e].T).chunk(2)
            out[t] += w * ((F.silu(gate) * up) @ w2[e].T)
    return out


@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_moe_equals_a_per_token_loop(renormalize):
    w13, w2 = _experts()
    x, logits = torch.randn(37, H), torch.randn(37, E) * 2
    got = _fused(w13, w2, renormalize)(x, logits)
    torch.testing.assert_close(got, _per_token(x, logits, w13, w2, renormalize), rtol=1e-5, atol=1e-5)


class _Summed(ParallelGroup):
    """A rank of a group of two whose all-reduce is left to the test (it sums the ranks' outputs)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_tensor_parallel_shards_sum_to_the_whole():
    w13, w2 = _experts(1)
    x, logits = torch.randn(9, H), torch.randn(9, E)
    ranks = [_fused(w13, w2, True, tp=_Summed(rank=r, size=2)) for r in range(2)]
    assert ranks[0].w13_weight.shape == (E, FF, H) and ranks[0].w2_weight.shape == (E, H, FF // 2)
    torch.testing.assert_close(ranks[0](x, logits) + ranks[1](x, logits), _fused(w13, w2, True)(x, logits),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not (cpu_kernels.available() and cpu_kernels.computes_bf16()),
                    reason="needs kernels that compute bf16 (the avx2 or avx512bf16 build)")
def test_experts_on_gemm_panels_compute_the_stacked_weights():
    w13, w2 = (w.to(torch.bfloat16) for w in _experts(3))
    moe = _fused(w13, w2, True).to(torch.bfloat16)
    x, logits = torch.randn(23, H, dtype=torch.bfloat16), torch.randn(23, E, dtype=torch.bfloat16)
    want = moe(x, logits)
    assert pack_experts_for_cpu(nn.ModuleList([moe])) == 1
    assert moe.gemm_weights is not None and moe.w13_weight.numel() == 0
    # NOTE: both sum exact bf16 products in fp32 and round once; only the order of the sums differs.
    torch.testing.assert_close(moe(x, logits), want, rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not (cpu_kernels.available() and cpu_kernels.computes_bf16()),
                    reason="needs kernels that compute bf16 (the avx2 or avx512bf16 build)")
@pytest.mark.parametrize(("renormalize", "in_dtype", "scheme"), [
    (True, False, None), (False, True, None), (True, False, "int8"), (False, True, "int4")],
    ids=["mixtral", "qwen3_moe", "mixtral-int8", "qwen3_moe-int4"])
def test_the_native_block_equals_router_and_experts_in_torch(renormalize, in_dtype, scheme):
    """moe.cpp's one call (router, top-k, experts, weighted sum) against the layer's torch
    routing of the same router logits over the same packed experts: outputs within bf16
    rounding (the softmax and the sums' order are the kernel's own), for 1, 3 and 40 rows."""
    from pagoda.layers.fused_moe import Router, bind_native_moe

    w13, w2 = (w.to(torch.bfloat16) for w in _experts(4))
    moe = _fused(w13, w2, renormalize, in_dtype).to(torch.bfloat16)
    router = Router(H, E).to(torch.bfloat16)
    router.weight.data = (torch.randn(E, H, generator=torch.Generator().manual_seed(5)) * 0.3).bfloat16()
    block = nn.ModuleDict({"gate": router, "experts": moe})
    if scheme is not None:
        quantize_model(block, scheme)
    pack_experts_for_cpu(block)
    if scheme is not None and moe.native is None:
        pytest.skip("this build's quantized experts have no native weights")
    assert moe.native is not None and not bind_native_moe(router, _fused(w13, w2, True, tp=_Summed(rank=0, size=2)))
    if scheme is not None and cpu_kernels.ops.panels_are_native():  # NOTE: on the panels, as dense layers
        assert moe.expert_methods is not None and all(m.panels is not None for p in moe.expert_methods for m in p)
        assert moe.native.max_rows == 1 << 62
    for rows in (1, 3, 40):
        x = torch.randn(rows, H, generator=torch.Generator().manual_seed(rows)).bfloat16()
        logits = cpu_kernels.ops.gemm(x, moe.native.router)  # NOTE: the same logits (a near tie may flip)
        got, want = moe.native(x), moe(x, logits)
        assert got.dtype == torch.bfloat16 and got.shape == x.shape
        # NOTE: rows whose k-th and next logits tie (bf16 logits do) may pick either expert:
        # the kernel the lower id, torch.topk as its sort leaves them.
        ranked = logits.float().sort(-1, descending=True).values
        clear = ranked[:, K - 1] != ranked[:, K]
        assert clear.sum() >= 0.9 * rows
        torch.testing.assert_close(got[clear].float(), want[clear].float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_experts_compute_their_dequantized_weights(scheme, monkeypatch):
    # NOTE: the methods' torch path, the definition (the kernels round x their own way and
    # are checked against it in test_quantization_kernels.py).
    monkeypatch.setattr(cpu_kernels, "takes", lambda x: False)
    w13, w2 = _experts(2)
    layer = nn.ModuleDict({"experts": _fused(w13, w2, False, in_dtype=True)})
    report = quantize_model(layer, scheme)
    moe = layer["experts"]
    assert isinstance(moe, FusedMoE) and moe.expert_methods is not None
    assert report.num_quantized == 2 * E and moe.w13_weight.numel() == 0
    dense13, dense2 = (torch.stack([pair[i].dequantize(torch.float32) for pair in moe.expert_methods])  # type: ignore[attr-defined]
                       for i in (0, 1))
    x, logits = torch.randn(5, H), torch.randn(5, E)
    # NOTE: int4 products take x rounded to bf16, as the kernels do.
    xin = x.to(torch.bfloat16).float() if scheme == "int4" else x
    torch.testing.assert_close(moe(x, logits), _per_token(xin, logits, dense13, dense2, False), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("engine", [dict(dtype="float32", quantization="int8"), dict(dtype="bfloat16")],
                         ids=["int8", "bf16"])
def test_quantized_and_bf16_moe_models_generate(engine, tiny_model_factory, monkeypatch):
    """int8: every expert packed; bf16: the experts on the GEMM's panels where the kernels
    compute bf16, each block one native call, inside the native decoder stack."""
    # NOTE: a forced plan for the dense linears: measuring one (the 49152-row LM head) took 4 s.
    monkeypatch.setenv("PAGODA_LINEAR_PLAN", "gemm")
    llm = LLM(str(tiny_model_factory("mixtral")), num_kv_blocks=64, **engine)
    experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedMoE)]
    assert len(experts) == 2
    if "quantization" in engine:
        assert all(m.expert_methods is not None for m in experts)
    elif cpu_kernels.available() and cpu_kernels.computes_bf16():
        assert all(m.gemm_weights is not None and m.native is not None for m in experts)
        assert llm.engine.runner.native_decoder is not None
    out = llm.generate(_prompts(2), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [8, 8]


# NOTE: slow (18 s on a 2-vCPU Zen 3: two worker processes); the shard arithmetic is checked
# above. int8: the down projections' scales are the group's max |w| per channel, so both
# layouts hold the same codes.
@pytest.mark.slow
@pytest.mark.parametrize("engine", [{}, {"quantization": "int8"}], ids=["fp32", "int8"])
def test_tensor_parallel_2_equals_one_process(engine, tiny_model_factory):
    model_dir = tiny_model_factory("qwen3_moe")
    want = pagoda_greedy(model_dir, _prompts(3), MAX_TOKENS, num_kv_blocks=64, **engine)
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, tensor_parallel_size=2, **engine)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        assert [o.outputs[0].token_ids for o in llm.generate(_prompts(3), params, use_tqdm=False)] == want
    finally:
        llm.engine.shutdown()


def test_sparse_layers_and_routing_follow_the_configs():
    """Which layers are sparse, as transformers builds them (decoder_sparse_step, mlp_only_layers)."""
    from transformers import MixtralConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from pagoda.models.moe import MoeDims

    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1)
    config = Qwen3MoeConfig(**small, num_hidden_layers=6, num_experts=4, moe_intermediate_size=8,
                            decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True)
    hf_sparse = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in Qwen3MoeForCausalLM(config).model.layers]
    moe = MoeDims.from_hf(config)
    assert [moe.is_sparse(i) for i in range(6)] == hf_sparse == [False, True, False, False, False, True]
    assert (moe.intermediate_size, moe.renormalize, moe.weights_in_model_dtype) == (8, True, True)
    mixtral = MoeDims.from_hf(MixtralConfig(**small, num_hidden_layers=2, num_local_experts=4))
    assert [mixtral.is_sparse(i) for i in range(2)] == [True, True]
    assert (mixtral.num_experts, mixtral.intermediate_size, mixtral.renormalize, mixtral.weights_in_model_dtype) == (
        4, 32, True, False)
