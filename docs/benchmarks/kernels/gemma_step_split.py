"""Where a Gemma 3 270M decode step goes (one stream, 32-token prompt): the self time of the
model's modules by kind over 30 steps, each linear by its class and quantization method (the
LM head apart), and what is left outside the model (sampler, scheduler).
Usage: python docs/benchmarks/kernels/gemma_step_split.py [SCHEME=gguf]   (bench quality's names)
"""
import collections, functools, statistics, sys, time
import torch
from pagoda.engine import LLMEngine
from pagoda.sampling_params import SamplingParams
from pagoda.bench.quality import SCHEME_ARGS
import pagoda.models.gemma3 as g
import pagoda.layers.linear as lin
from pagoda.layers import attention as att

scheme = sys.argv[1] if len(sys.argv) > 1 else "gguf"
eng = LLMEngine.from_engine_args("gemma3-270m", (), log_stats=False, enable_prefix_caching=False, **SCHEME_ARGS[scheme])
acc = collections.defaultdict(float); stack = []
def wrap(cls, name, label):
    f = getattr(cls, name)
    @functools.wraps(f)
    def w(*a, **k):
        t = time.perf_counter(); stack.append(0.0)
        r = f(*a, **k)
        dt = time.perf_counter() - t; inner = stack.pop(); acc[label] += dt - inner
        if stack: stack[-1] += dt
        return r
    setattr(cls, name, w)
wrap(g.Gemma3ForCausalLM, "compute_logits", "LM head (compute_logits)")
wrap(g.Gemma3ForCausalLM, "forward", "model forward other (embed, final norm)")
wrap(g.Gemma3DecoderLayer, "forward", "layer other (norms, residuals)")
wrap(g.Gemma3Attention, "forward", "attention other (q/k norm, rope, split)")
wrap(g.Gemma3MLP, "forward", "mlp other (gelu-mul)")
f0 = lin.Linear.forward
def lw(self, *a, **k):
    t = time.perf_counter(); stack.append(0.0)
    r = f0(self, *a, **k)
    dt = time.perf_counter() - t; inner = stack.pop()
    w = getattr(self, "weight", None)
    label = f"linear {type(self).__name__} {tuple(w.shape) if w is not None else '?'} {type(self.method).__name__} rows {a[0].shape[0]}"
    acc[label] += dt - inner
    if stack: stack[-1] += dt
    return r
lin.Linear.forward = lw
wrap(att.PagedAttention, "forward", "paged attention")
ids = torch.randint(100, 40000, (32,), generator=torch.Generator().manual_seed(0)).tolist()
eng.add_request(None, ids, SamplingParams(max_tokens=60, ignore_eos=True, temperature=0))
for _ in range(6): eng.step()
acc.clear(); steps = []
for _ in range(30):
    t = time.perf_counter(); eng.step(); steps.append(time.perf_counter() - t)
n = len(steps)
print(f"step median {statistics.median(steps)*1e3:.1f} ms, mean {sum(steps)/n*1e3:.1f}")
for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
    print(f"  {k:45s} {v/n*1e3:7.2f} ms/step")
print(f"  {'outside the model (sampler, scheduler, ...)':45s} {(sum(steps)-sum(acc.values()))/n*1e3:7.2f}")
