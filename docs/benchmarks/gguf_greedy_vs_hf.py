"""Greedy tokens of a GGUF in pagoda (fp32, bf16, --quantization gguf) against transformers'
`generate` in fp32 on the same file, and transformers' top-3 logits for each prompt's first token
(to tell a near-tie from a fault): where each pagoda run first departs, of N tokens.
Usage: python docs/benchmarks/gguf_greedy_vs_hf.py FILE.gguf [N]
"""
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagoda import LLM, SamplingParams

path, n = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 12
prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]
tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
refs = []
for text in prompts:
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        top = hf(ids).logits[0, -1].topk(3)
        refs.append(hf.generate(ids, max_new_tokens=n, do_sample=False)[0, ids.shape[1]:].tolist())
    print(f"{text!r}: transformers fp32 top-3 first-token logits",
          [(int(i), round(float(v), 3)) for v, i in zip(top.values, top.indices, strict=True)])
for name, kwargs in [("fp32", {"dtype": "float32"}), ("bf16", {}), ("gguf", {"quantization": "gguf"})]:
    llm = LLM(str(path), max_model_len=512, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    firsts = [next((i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b), n) for got, ref in zip(outs, refs, strict=True)]
    print(f"pagoda {name}: first departure from transformers fp32 at token {firsts} of {n}")
    del llm
