"""The bf16 engine path (native kernels) against fp32, on the tiny random models.

Bound, and why: bf16 keeps 8 significant bits, so a bf16 forward pass differs from fp32 by an
amount set by bf16 itself, whatever computes it. The torch path in bf16 (Hugging Face's
rounding points, oneDNN/F.linear) is the reference for that amount: the kernels may not add
more than half of it again (max logit error <= 1.5x the torch bf16 path's, + 0.02). Greedy
tokens are compared through the same logits: the argmax must agree wherever fp32's top-2 gap
exceeds twice that bound. The logits come from the last prompt token decoded as a batch of
four (the GEMV, decode-attention, slot-write, rotary and norm kernels all run).
"""

from __future__ import annotations

import pytest
import torch

from pagoda.layers import cpu_kernels
from pagoda.llm import LLM
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler import SchedulerOutput

BLOCKS_PER_REQUEST = 8


def prompts(n: int = 8) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 49000, (int(k),), generator=gen).tolist() for k in torch.randint(5, 90, (n,), generator=gen)]


def last_token_logits(path: str, dtype: str, batch: list[list[int]]) -> torch.Tensor:
    """Prefills all but each prompt's last token, then decodes the last tokens in one step."""
    llm = LLM(path, dtype=dtype, num_kv_blocks=BLOCKS_PER_REQUEST * len(batch) + 1)
    runner = llm.engine.runner
    reqs = []
    for i, p in enumerate(batch):
        r = Request(f"r{i}", p, SamplingParams(max_tokens=1))
        r.block_ids = list(range(i * BLOCKS_PER_REQUEST, (i + 1) * BLOCKS_PER_REQUEST))
        reqs.append(r)
    sched = SchedulerOutput()
    for r, p in zip(reqs, batch, strict=True):
        sched.add(r, len(p) - 1)
    runner.execute(sched)
    for r, p in zip(reqs, batch, strict=True):
        r.num_computed_tokens = len(p) - 1
    decode = SchedulerOutput()
    for r in reqs:
        decode.add(r, 1)
    _, inputs = runner.preparer.prepare(decode)
    return runner.logits(inputs).float()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral_swa"])
def test_bf16_kernels_stay_within_bf16_error(arch: str, tiny_model_factory, monkeypatch) -> None:
    path = str(tiny_model_factory(arch))
    batch = prompts()[:4]
    fp32 = last_token_logits(path, "float32", batch)
    native = last_token_logits(path, "bfloat16", batch)
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    torch_bf16 = last_token_logits(path, "bfloat16", batch)
    reference_error = (torch_bf16 - fp32).abs().max().item()
    bound = 1.5 * reference_error + 0.02
    assert (native - fp32).abs().max().item() <= bound
    top2 = fp32.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * bound
    assert torch.equal(native.argmax(-1)[clear], fp32.argmax(-1)[clear])
