"""Per-phase time of a decode step (works on the code before and after the kernels)."""
import os, time, argparse, functools, collections
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
from pagoda.engine import LLMEngine
from pagoda.sampling_params import SamplingParams
import pagoda.layers.linear as lin, pagoda.layers.norm as nrm, pagoda.layers.attention as att, pagoda.models.llama as lm
ap = argparse.ArgumentParser(); ap.add_argument("--batch", type=int, default=1); ap.add_argument("--prompt", type=int, default=32)
ap.add_argument("--steps", type=int, default=50); ap.add_argument("--reps", type=int, default=1); a = ap.parse_args()
eng = LLMEngine.from_engine_args("smollm2", (), dtype="bfloat16", log_stats=False, enable_prefix_caching=False,
                                 max_num_batched_tokens=max(4096, a.batch * a.prompt))
acc = collections.defaultdict(float)
stack = []
def wrap(cls, name, label):
    f = getattr(cls, name, None)
    if f is None: return
    @functools.wraps(f)
    def w(*args, **kw):
        t = time.perf_counter(); stack.append(0.0)
        r = f(*args, **kw)
        dt = time.perf_counter() - t; inner = stack.pop()
        acc[label] += dt - inner
        if stack: stack[-1] += dt
        return r
    setattr(cls, name, w)
wrap(lin.Linear, "forward", "linear (incl. LM head)")
wrap(nrm.RMSNorm, "forward", "rmsnorm / residual add")
wrap(nrm.RMSNorm, "forward_with_residual", "rmsnorm / residual add")
wrap(att.PagedAttention, "forward", "attention + K/V write")
wrap(lm.LlamaMLP, "forward", "mlp other (silu-mul)")
wrap(lm.LlamaAttention, "forward", "attn block other (split, rotary)")
wrap(lm.LlamaDecoderLayer, "forward", "layer glue (residual adds)")
wrap(lm.LlamaForCausalLM, "forward", "model glue (embed, rotary table)")
wrap(type(eng.runner), "execute", "runner other (prepare, sampler)")
wrap(LLMEngine, "step", "engine other (scheduler, outputs)")
for i in range(a.batch):
    ids = torch.randint(100, 40000, (a.prompt,), generator=torch.Generator().manual_seed(i)).tolist()
    eng.add_request(None, ids, SamplingParams(max_tokens=a.steps * a.reps + 20, ignore_eos=True, temperature=0))
for _ in range(6): eng.step()
for rep in range(a.reps):
    acc.clear()
    t0 = time.perf_counter()
    for _ in range(a.steps): eng.step()
    total = (time.perf_counter() - t0) / a.steps
    print(f"batch {a.batch}: step {total*1e3:.2f} ms ({a.batch/total:.1f} tok/s)")
    for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
        print(f"  {k:34s} {v/a.steps*1e3:7.3f} ms")
