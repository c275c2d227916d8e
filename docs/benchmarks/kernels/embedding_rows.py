"""The token embedding read from a tied, packed LM head (`VocabParallelEmbedding` over the head's records): microseconds a
call for 1, 16 and 512 ids, SmolLM2 under --quantization int4 (int8 LM head per row) and its
Q4_K_M GGUF ($PEERS's, Q8_0 LM head) under gguf.
Usage: python docs/benchmarks/kernels/embedding_rows.py [int4|gguf]
"""
import os
import sys
import time

import torch

from pagoda import LLM

scheme = sys.argv[1] if len(sys.argv) > 1 else "int4"
gguf = os.path.expanduser("~/.cache/pagoda-peers/models-llamacpp/SmolLM2-135M-Instruct.Q4_K_M.gguf")
llm = LLM(gguf if scheme == "gguf" else "smollm2", quantization=scheme, max_model_len=512)
embedding = llm.engine.runner.model.embed_tokens
for n in (1, 16, 512):
    ids = torch.randint(0, 49000, (n,))
    embedding(ids)
    start = time.perf_counter()
    for _ in range(200):
        embedding(ids)
    print(f"{scheme}: {n} ids {(time.perf_counter() - start) / 200 * 1e6:.1f} us")
