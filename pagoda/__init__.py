"""pagoda: fast LLM serving with a paged KV cache and continuous batching."""

import os

# NOTE: OpenMP spin-waiting on shared cores slowed every step 3-10x here (see
# docs/benchmarks.md); passive waiting must be chosen before torch starts its thread pool.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import importlib  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

if TYPE_CHECKING:
    from pagoda.llm import LLM
    from pagoda.lora import LoRARequest
    from pagoda.outputs import (
        CompletionOutput,
        EmbeddingRequestOutput,
        PoolingRequestOutput,
        RequestOutput,
    )
    from pagoda.pooling import PoolingParams
    from pagoda.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "PoolingParams",
           "EmbeddingRequestOutput", "PoolingRequestOutput", "LoRARequest"]
__version__ = "0.1.0"

# NOTE: imported on first use, not with the package: `python -m pagoda.worker` (and
# `pagoda.core_client`) would otherwise find their own module imported already, through
# the engine, before running it as __main__ (runpy's double import and its warning).
_HOMES = {"LLM": "pagoda.llm", "SamplingParams": "pagoda.sampling_params",
          "RequestOutput": "pagoda.outputs", "CompletionOutput": "pagoda.outputs",
          "PoolingParams": "pagoda.pooling", "EmbeddingRequestOutput": "pagoda.outputs",
          "PoolingRequestOutput": "pagoda.outputs", "LoRARequest": "pagoda.lora"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'pagoda' has no attribute {name!r}")
