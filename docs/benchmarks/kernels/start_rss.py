"""Resident memory right after an engine is built (no request run, no idle trim yet): what a
server holds once it says it is ready. Run it from two checkouts to compare them.
Usage: python docs/benchmarks/kernels/start_rss.py MODEL [SCHEME]   (SCHEME: bf16 or gguf)
"""
import sys

from pagoda import LLM

kwargs = {"quantization": "gguf"} if len(sys.argv) > 2 and sys.argv[2] == "gguf" else {}
llm = LLM(sys.argv[1], **kwargs)
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(sys.argv[1:], {k: f"{int(status[k].split()[0]) / 1024:.0f} MiB" for k in ("VmRSS", "VmHWM")})
