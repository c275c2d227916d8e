"""What the loaded weights become before the first step, decided once, in one place and order.

vLLM's `process_weights_after_loading`: after `models.loader.load_model` (which already keeps a
GGUF's blocks or a GPTQ/AWQ checkpoint packed, `finish_gguf_load`), `process_weights_after_loading`
1. quantizes (int8/int4/fp8 by `quantize_model`) or finishes a packed load (`finish_gguf`),
   freeing the float weights the packed methods replace (a tied embedding then reads the
   head's records: `VocabParallelEmbedding`), and logs the weight memory before and after;
2. on CPU with the native kernels, plans the bf16 linears (`plan_linears`: measured on this CPU,
   cached or forced, logged: kernel_tuning.py), packs every linear for its plan's paths
   (`prepack_for_cpu`) and the mixture-of-experts experts (`pack_experts_for_cpu`), and logs the
   weights as the kernels hold them.
Each layer's method is its one piece of execution state, made here (or, for a packed load's
records, by the loader) and never changed after; the runner then builds its native decoder stack
over these weights when it binds the KV pool.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from pagoda.layers.fused_moe import pack_experts_for_cpu
from pagoda.layers.kernel_plan import KernelPlan
from pagoda.layers.linear import prepack_for_cpu
from pagoda.layers.quantization import QuantizationReport, linear_methods, method_bytes
from pagoda.layers.quantization.gptq_awq import CHECKPOINT_METHODS
from pagoda.layers.quantization.methods import PackedLinearMethod
from pagoda.model_runner import step_threads

logger = logging.getLogger("pagoda")


@dataclass(frozen=True)
class WeightProcessing:
    """How the loaded weights are processed.

    Args:
        quantization: the resolved scheme ('int8', 'int4', 'fp8', or 'gguf'/'gptq'/'awq' for
            weights loaded packed), or None.
        group_size: int4's group of inputs.
        device: where the model lives; the CPU kernels' plan and packing happen on CPU only,
            and not with PAGODA_DISABLE_CPU_KERNELS set.
    """

    quantization: str | None = None
    group_size: int = 32
    device: torch.device = torch.device("cpu")

    @property
    def packs_for_cpu_kernels(self) -> bool:
        return self.device.type == "cpu" and not os.environ.get("PAGODA_DISABLE_CPU_KERNELS")


@dataclass(frozen=True)
class ProcessedWeights:
    """What processing did: the quantization report and the CPU kernels' plan (None: none)."""

    report: QuantizationReport | None
    plan: KernelPlan | None


def process_weights_after_loading(model: nn.Module, processing: WeightProcessing) -> ProcessedWeights:
    """Quantizes, plans and packs `model`'s loaded weights (see the module's docstring)."""
    report = quantize(model, processing.quantization, processing.group_size,
                      processing.device) if processing.quantization else None
    plan = None
    if processing.packs_for_cpu_kernels:
        embedding = getattr(model, "embed_tokens", None)
        keep = {id(embedding.weight)} if embedding is not None else set()
        plan = plan_linears(model)
        records = method_bytes(model) if report is not None else 0
        prepack_for_cpu(model, keep=keep, plan=plan)
        pack_experts_for_cpu(model)
        if report is not None:
            log_panels(model, report, records)
    return ProcessedWeights(report, plan)


def quantize(model: nn.Module, scheme: str, group_size: int, device: torch.device) -> QuantizationReport:
    """Applies `scheme` to the loaded model (GGUF-packed weights and GPTQ/AWQ checkpoints were
    packed while loading) and logs the weight memory before and after."""
    from pagoda.layers.quantization import finish_gguf, quantize_model

    packed_on_load = scheme in ("gguf", *CHECKPOINT_METHODS)
    report = finish_gguf(model, scheme) if packed_on_load else quantize_model(model, scheme, group_size, device)
    logger.info("%s", report.describe())
    return report


def plan_linears(model: nn.Module, retune: bool = False) -> KernelPlan | None:
    """The kernel plan of the model's bf16 linears on this CPU (kernel_tuning.py), logged."""
    from pagoda.layers import cpu_kernels
    from pagoda.layers.kernel_tuning import plan_for_model

    lib = cpu_kernels.library()
    max_threads = torch.get_num_threads()
    # NOTE: the build (its name carries a digest of the kernel sources), not only the variant: a
    # changed kernel makes the old timings stale; so does the GEMM's tile choice (gemm_tiles.py).
    ops = cpu_kernels.ops
    build = (f"{lib.path.stem}+fma{ops.GEMM_FMA_ROWS}+amx{ops.GEMM_AMX_ROWS}+pf{ops.GEMM_PREFETCH_ROWS}"
             if lib is not None else "none")
    plan = plan_for_model(model, build,
                          lambda rows: step_threads(rows, max_threads), retune=retune)
    if plan is not None:
        logger.info("%s", plan.describe())
    return plan


def log_panels(model: nn.Module, report: QuantizationReport, records: int) -> None:
    """Logs the weights as the CPU kernels hold them where repacking changed their size (e.g.
    GGUF's Q5_0 as 5-bit panels instead of 8-bit records), `records` the methods' bytes before."""
    now = report.bytes_after - records + method_bytes(model)
    if now == report.bytes_after:
        return
    kinds = Counter(m.name for m in linear_methods(model) if isinstance(m, PackedLinearMethod))
    logger.info("%s", report.describe_panels(now, dict(kinds)))
