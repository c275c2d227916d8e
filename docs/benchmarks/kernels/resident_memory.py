"""Resident memory of `LLM('smollm2')` after one short generation and malloc_trim (the KV pool
untouched). Run it from two checkouts to compare them. Prints VmRSS and VmHWM in MB.
"""
import ctypes

from pagoda import LLM, SamplingParams

llm = LLM("smollm2")
llm.generate(["Hello there, how are you today?"], SamplingParams(max_tokens=16, temperature=0))
ctypes.CDLL("libc.so.6").malloc_trim(0)
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print({k: f"{int(status[k].split()[0]) / 1024:.0f} MB" for k in ("VmRSS", "VmHWM")})
