"""Grammar compile latency through the sandbox processes against in process: SmolLM2's
tokenizer, 20 JSON schemas never seen before (the median), then the same 20 again (cached).
Usage: python docs/benchmarks/kernels/grammar_compile.py
"""
import statistics
import time

from pagoda.config import LimitsConfig
from pagoda.models.loader import load_tokenizer, resolve_model_path
from pagoda.structured_output import GrammarCompiler, StructuredOutputsParams

tok = load_tokenizer(resolve_model_path("smollm2"))


def schema(i: int) -> dict:
    return {"type": "object", "required": ["name", "age"], "additionalProperties": False,
            "properties": {"name": {"type": "string", "maxLength": 20 + i}, "age": {"type": "integer"},
                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}}


def timed(compiler: GrammarCompiler, count: int = 20) -> float:
    times = []
    for i in range(count):
        start = time.perf_counter()
        compiler.compile(StructuredOutputsParams(json=schema(i)))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


for workers in (0, 2):
    compiler = GrammarCompiler(tok, 49152, limits=LimitsConfig(grammar_compile_workers=workers))
    start = time.perf_counter()
    compiler.compile(StructuredOutputsParams(json_object=True))
    first = time.perf_counter() - start
    new, cached = timed(compiler), timed(compiler)
    print(f"grammar_compile_workers={workers}: first constraint {first:.2f} s; "
          f"new schema median {new:.2f} ms, cached {cached:.3f} ms")
    compiler.close()
