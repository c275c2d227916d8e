"""Gemma 3 270M's KV pool with one pool for every layer ("before") or with its sliding-window
layers in a KV cache group of their own ("after"): the start-up log's pool and
maximum-concurrency lines, then the KV report while one long request decodes.

    PYTHONPATH=. python docs/benchmarks/sliding_window_kv.py before|after PROMPT_TOKENS MAX_NUM_SEQS
"""

import logging
import sys
import time

from pagoda import LLM, SamplingParams
from pagoda.metrics import format_kv_memory_report

logging.basicConfig(level=logging.INFO, format="%(message)s")
mode, prompt_len, max_num_seqs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = LLM("gemma3-270m", max_model_len=32768, kv_cache_memory="4GiB", max_num_seqs=max_num_seqs,
          disable_hybrid_kv_cache_manager=mode == "before")
engine = llm.engine
engine.add_request("long", [100 + i % 5000 for i in range(prompt_len)],
                   SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
start = time.time()
running = engine.scheduler.running
while not running or running[0].num_output_tokens < 4:
    engine.step()
print(f"--- {mode}: one request of {prompt_len} prompt tokens, decoding ({time.time() - start:.0f} s)")
print(format_kv_memory_report(engine.kv_report()))
