"""`pagoda bench`: serve (load generator), sweep, throughput, latency and memory benchmarks.

Modules: datasets (workloads), endpoints (one timed streamed request), serving (the load),
report (vLLM's metrics and result block), serve_command (vLLM's flags), sweep, backends
(pagoda and transformers offline), throughput, latency, memory (the KV replay), plots, cli.
"""
