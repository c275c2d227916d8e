"""Gemma 3 270M (Q4_K_M, `--quantization gguf`) single-stream decode with `GemmaRMSNorm` on
its kernel and on its torch path (Hugging Face's five ops), alternating in one process, and
the norms' share of a decode's time under cProfile (torch path). Prints the CPU it ran on.
Usage: python docs/benchmarks/kernels/gemma_norm.py [ROUNDS] [TOKENS]   (default 4 128)
"""
import cProfile, pstats, sys, time
import torch
from pagoda import LLM, SamplingParams
from pagoda.layers import norm

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 4
TOKENS = int(sys.argv[2]) if len(sys.argv) > 2 else 128
PROMPT = "Hello there, tell me a story."


def torch_forward(self, x):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
    return (h * (1.0 + self.weight.float())).to(x.dtype)


def torch_with_residual(self, x, residual):
    residual = x + residual
    return torch_forward(self, residual), residual


PATHS = {"torch": (torch_forward, torch_with_residual),
         "kernel": (norm.GemmaRMSNorm.forward, norm.GemmaRMSNorm.forward_with_residual)}


def use(path: str) -> None:
    norm.GemmaRMSNorm.forward, norm.GemmaRMSNorm.forward_with_residual = PATHS[path]


cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
print(f"CPU: {cpu}; torch threads {torch.get_num_threads()}")
llm = LLM("gemma3-270m", max_model_len=1024, quantization="gguf")
params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
for rnd in range(ROUNDS):
    for path in PATHS:
        use(path)
        llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        start = time.perf_counter()
        llm.generate([PROMPT], params, use_tqdm=False)
        print(f"round {rnd} {path:6s} {TOKENS / (time.perf_counter() - start):.1f} tok/s", flush=True)
use("torch")
profile = cProfile.Profile()
profile.runcall(llm.generate, [PROMPT], params, use_tqdm=False)
stats = pstats.Stats(profile)
total = max(v[3] for v in stats.stats.values())
# NOTE: torch_forward's cumulative time holds the calls through torch_with_residual too,
# whose own time (the residual add) comes on top.
own = {name: v for (f, _, name), v in stats.stats.items() if f.endswith("gemma_norm.py")}
norms = own["torch_forward"][3] + own["torch_with_residual"][2]
print(f"torch-path norms: {100 * norms / total:.0f}% of a profiled decode of {TOKENS} tokens")
