"""Greedy SmolLM2 answers in bf16 vs fp32: the common prefix of each (docs/benchmarks.md)."""
import torch
from pagoda import LLM, SamplingParams
qs = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers and explain why they are prime.",
      "Explain photosynthesis in two sentences.", "What is 17 times 23?", "Give me a short recipe for pancakes."]
res = {}
for dt in ["float32", "bfloat16"]:
    llm = LLM("smollm2", dtype=dt, max_model_len=512, kv_cache_memory="256MiB")
    ids = [list(llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False)) for q in qs]
    res[dt] = [o.outputs[0].token_ids for o in llm.generate(ids, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)]
def common(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y: break
        n += 1
    return n
for a, b in zip(res["float32"], res["bfloat16"]):
    print(len(a), len(b), "common prefix", common(a, b))
