"""pagoda: fast LLM serving with a paged KV cache and continuous batching."""

import os

# NOTE: OpenMP spin-waiting on shared cores slowed every step 3-10x here (see
# docs/benchmarks.md); passive waiting must be chosen before torch starts its thread pool.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


from pagoda.llm import LLM  # noqa: E402
from pagoda.outputs import CompletionOutput, RequestOutput  # noqa: E402
from pagoda.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
