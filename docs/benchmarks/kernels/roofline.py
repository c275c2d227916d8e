"""A roofline of SmolLM2 (bf16) on this CPU: for each workload, the weight-stream floor (bytes of
weights the steps read / the measured stream rate) and the compute floor (FLOPs / the measured
matrix peak), against pagoda's measured time, as a fraction of the binding floor.

Measured here, two threads:
- stream rate: `torch.amax` over a 512 MiB fp32 buffer (best of 5), what one pass of the
  weights can hope for;
- matrix peak: the fastest of the own GEMM (bf16 weights packed, 512 rows, SmolLM2's
  gate/up shape) and torch's fp32 matmul (MKL, 512 x 576 x 3072), best of 20 (of 5, a busy
  host's neighbours sometimes halved it).
Workloads (`LLM("smollm2")`, prefix caching off, one token a step per sequence):
- decode, 1 and 16 streams: (time of 65 tokens - time of 1) / 64, a step's time;
- prefill, one 2,000-token prompt at a 512-token budget (4 steps; the server's default): time to
  the first token; and at a 2,048-token budget (one step; vLLM's CPU server default).
A step reads every linear's weights once (the LM head included, for the rows that sample);
FLOPs are 2 x weights x rows, plus attention's 4 x heads x head_dim x keys per query row.
Usage: python docs/benchmarks/kernels/roofline.py
"""
import torch
from best_time import best

from pagoda import LLM, SamplingParams
from pagoda.layers import cpu_kernels
from pagoda.layers.cpu_kernels import ops

torch.set_num_threads(2)
cpu_kernels.library()
ops.set_num_threads(2)


flat = torch.randn(128 * 2**20)
stream = flat.numel() * 4 / best(lambda: torch.amax(flat)) / 1e9
w = ops.PackedWeight((torch.randn(3072, 576) * 0.05).to(torch.bfloat16))
x = torch.randn(512, 576).to(torch.bfloat16)
gemm = 2 * 512 * 576 * 3072 / best(lambda: ops.gemm(x, w), n=20) / 1e9
a, b = torch.randn(512, 576), torch.randn(576, 3072)
mkl = 2 * 512 * 576 * 3072 / best(lambda: a @ b, n=20) / 1e9
peak = max(gemm, mkl)
print(f"stream {stream:.1f} GB/s; matrix peak {peak:.0f} GFLOP/s (own GEMM {gemm:.0f}, MKL fp32 {mkl:.0f})")

llm = LLM("smollm2", max_num_batched_tokens=512, max_model_len=4096, enable_prefix_caching=False)
one_step = LLM("smollm2", max_num_batched_tokens=2048, max_model_len=4096, enable_prefix_caching=False)
model = llm.engine.runner.model
d = model.dims
heads, head_dim, layers, hidden = d.num_heads, d.head_dim, d.num_layers, d.hidden_size
# NOTE: from the shapes (packed layers may no longer hold their `weight`): qkv, o, gate/up, down.
layer_weights = layers * hidden * ((heads + 2 * d.num_kv_heads) * head_dim + heads * head_dim
                                   + 3 * d.intermediate_size)
head_weights = d.vocab_size * hidden
gen = torch.Generator().manual_seed(0)
prompt = torch.randint(100, 40000, (2000,), generator=gen).tolist()


def timed(prompts, max_tokens, engine=llm):  # noqa: ANN001, ANN201
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return best(lambda: engine.generate(prompts, params, use_tqdm=False), n=2)


def row(name, seconds, steps, rows, attn_keys, sampled):  # noqa: ANN001, ANN201
    bytes_read = steps * (layer_weights + head_weights) * 2
    flops = 2 * layer_weights * rows + 2 * head_weights * sampled + 4 * heads * head_dim * attn_keys * layers
    floor_stream, floor_compute = bytes_read / stream / 1e9, flops / peak / 1e9
    binding = max(floor_stream, floor_compute)
    which = "stream" if floor_stream >= floor_compute else "compute"
    print(f"| {name} | {seconds * 1e3:.1f} ms | {floor_stream * 1e3:.1f} ms | {floor_compute * 1e3:.1f} ms | "
          f"{which} | {binding / seconds:.0%} |")


print("| workload | pagoda | stream floor | compute floor | binding | pagoda at |")
print("|---|---|---|---|---|---|")
for streams in (1, 16):
    prompts = [prompt[i * 100:i * 100 + 100] for i in range(streams)]
    step = (timed(prompts, 65) - timed(prompts, 1)) / 64
    row(f"decode step, {streams} stream(s), ~130-token contexts", step, 1, streams, streams * 130, streams)
ttft = timed([prompt], 1)
row("prefill, 2,000 tokens (4 steps of 512)", ttft, 4, 2000, 2000 * 2000 // 2, 1)
ttft = timed([prompt], 1, one_step)
row("prefill, 2,000 tokens (1 step of 2,048)", ttft, 1, 2000, 2000 * 2000 // 2, 1)
