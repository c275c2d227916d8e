"""The prefill attention cases the kernel benchmarks share: one chunk of a prompt over its cached
prefix through the paged-attention kernel (SmolLM2's heads, bf16, blocks of 16), and the four
chunks of a 2,000-token prompt at a 512-token budget. Imported by the scripts beside it (run as
`python docs/benchmarks/kernels/SCRIPT.py`, which puts this folder on the path).
"""
from collections.abc import Callable

import torch

from pagoda.layers.cpu_kernels import ops

H, KV, D, BS = 9, 3, 64, 16
PROMPT_CHUNKS = [(512, 0), (512, 512), (512, 1024), (464, 1536)]  # (rows, cached prefix)


def chunk_case(n: int, cached: int) -> Callable[[], object]:
    """A call of the kernel for n query rows after `cached` keys, random K/V and queries."""
    seq_len = cached + n
    blocks = -(-seq_len // BS)
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(blocks + 2, BS, KV, D, generator=g).bfloat16()
    vc = torch.randn(blocks + 2, BS, KV, D, generator=g).bfloat16()
    table, lens, qsl = torch.arange(blocks)[None].contiguous(), torch.tensor([seq_len]), torch.tensor([0, n])
    q = torch.randn(n, H, D, generator=g).bfloat16()
    return lambda: ops.paged_attention(q, kc, vc, table, lens, qsl, D**-0.5, 0)
