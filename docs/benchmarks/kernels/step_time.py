"""Median LLMEngine.step() time in steady decode (--model, default smollm2): --batch sequences of --prompt random tokens,
after the prefill and 5 warm-up steps; --profile prints torch.profiler's operator table for 5
steps first; --scheme takes `pagoda bench quality`'s names (bf16, int8, int4, gguf, kv-fp8, ...);
--layer-path runs decode steps layer by layer instead of the one-call native decoder stack;
--small-pages leaves each packed weight where it was packed (4 KB pages) instead of gathering
them into one huge-page buffer; --no-rotation keeps Q and K unrotated over an fp8 pool.
Env KT sets the kernels' thread count.
"""
import os, time, statistics, argparse
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
from pagoda.bench.quality import SCHEME_ARGS
from pagoda.engine import LLMEngine
from pagoda.sampling_params import SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="smollm2")
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--prompt", type=int, default=32)
ap.add_argument("--steps", type=int, default=60)
ap.add_argument("--dtype", default="bfloat16")
ap.add_argument("--profile", action="store_true")
ap.add_argument("--layer-path", action="store_true")
ap.add_argument("--scheme", default="bf16", choices=list(SCHEME_ARGS))
ap.add_argument("--small-pages", action="store_true")
ap.add_argument("--no-rotation", action="store_true")
a = ap.parse_args()
if a.no_rotation:
    from pagoda.layers.attention import PagedAttention
    PagedAttention.rotates_qk = lambda self, pool: False
if a.small_pages:
    from pagoda.layers import linear
    from pagoda.layers.cpu_kernels import ops
    ops.gather_in_huge_pages = lambda weights: None
    def each_on_its_own(modules):
        return [ops.PackedWeight(m.weight.detach()) for m in modules]
    linear._pack_in_huge_pages = each_on_its_own
eng = LLMEngine.from_engine_args(a.model, (), dtype=a.dtype, log_stats=False, enable_prefix_caching=False,
                                 max_num_batched_tokens=max(4096, a.batch * a.prompt), **SCHEME_ARGS[a.scheme])
if a.layer_path:
    eng.runner.native_decoder = None
if os.environ.get("KT"):
    from pagoda.layers.cpu_kernels import ops
    ops.set_num_threads(int(os.environ["KT"]))
g = torch.Generator().manual_seed(0)
for i in range(a.batch):
    ids = torch.randint(100, 40000, (a.prompt,), generator=g).tolist()
    eng.add_request(None, ids, SamplingParams(max_tokens=a.steps + 20, ignore_eos=True, temperature=0))
eng.step()  # prefill
for _ in range(5): eng.step()
times = []
if a.profile:
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5): eng.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
for _ in range(a.steps):
    t = time.perf_counter(); eng.step(); times.append(time.perf_counter() - t)
med = statistics.median(times)
print(f"batch={a.batch} prompt={a.prompt} dtype={a.dtype} step median {med*1e3:.2f} ms  p10 {sorted(times)[len(times)//10]*1e3:.2f}  -> {a.batch/med:.1f} tok/s  scheme={a.scheme}{' layer-path' if a.layer_path else ''}{' small-pages' if a.small_pages else ''}{' no-rotation' if a.no_rotation else ''}")
