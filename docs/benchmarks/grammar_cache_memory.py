"""RSS of the engine's grammar cache (`GrammarCompiler`, an LRU of 256 compiled constraints)
as distinct 300-way `choice` constraints fill it (the soak's hostile ones before `5e4847a`):
it grows until the cache is full, then stays. Usage: python docs/benchmarks/grammar_cache_memory.py
"""
import gc, random
from pagoda.models.loader import load_tokenizer
from pagoda.structured_output import GrammarCompiler, StructuredOutputsParams
from pagoda.config import LimitsConfig
def rss(): return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
from pagoda.models.loader import resolve_model_path
tok = load_tokenizer(resolve_model_path("smollm2"))
gc_ = GrammarCompiler(tok, 49152, limits=LimitsConfig())
rng = random.Random(0)
def one():
    return StructuredOutputsParams(choice=[f"option {i} of {rng.randrange(10**6)}" for i in range(300)])
gc_.compile(one()); base = rss()
for n in range(1, 601):
    gc_.compile(one())
    if n % 100 == 0:
        gc.collect(); print(f"{n} cached 300-way choices: +{rss() - base:.1f} MB ({(rss() - base) / n:.2f} MB each)")
