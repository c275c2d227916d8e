"""Turning a step's scheduled requests into the model's input tensors.

`InputPreparer.prepare` orders the batch (first the rows the attention backend's batched call
takes: with the native CPU kernels every row, with torch's SDPA the one-token decodes; then
the rest), flattens it without padding, and builds `input_ids`, `positions`, `slot_mapping`,
the attention metadata (built by the backend, attention_backend.py) and the rows
whose logits are needed (sampling rows, then the prompt rows of requests that ask for
prompt logprobs), and the hidden rows pooled requests pool (pooling.py; a pooled request
has no sampling row). The result, `ModelInputs`, holds only tensors and plain data; every
parallel worker prepares its own from the step's `WorkerRequest` copies (worker_step.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from pagoda.kv_cache import group_block_ids
from pagoda.layers.attention_backend import (
    AttentionBackend,
    AttentionMetadata,
    GroupedAttentionMetadata,
    NativeAttentionMetadata,
    TorchAttentionMetadata,
)
from pagoda.lora import LoRARequest
from pagoda.pooling import PoolRows, positions_to_pool
from pagoda.prompt_logprobs import PromptRows, positions_to_score
from pagoda.request import Request
from pagoda.scheduler import SchedulerOutput

Span = TypeVar("Span", PromptRows, PoolRows)


@dataclass
class ModelInputs:
    """One step's model inputs; `logits_rows` index the hidden rows to project to logits:
    first the sampling rows, then the prompt positions `prompt_rows` score."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor
    num_tokens: int
    prompt_rows: list[PromptRows] = field(default_factory=list)
    pool_rows: list[PoolRows] = field(default_factory=list)  # NOTE: hidden rows `pool_row_ids`
    pool_row_ids: torch.Tensor | None = None
    # NOTE: (adapter, first row, row count) of each request that runs with a LoRA adapter
    lora_rows: list[tuple[LoRARequest, int, int]] = field(default_factory=list)

    @property
    def num_sample_rows(self) -> int:
        return self.logits_rows.numel() - sum(span.count for span in self.prompt_rows)


def lora_rows(reqs: list[Request], counts: list[int]) -> list[tuple[LoRARequest, int, int]]:
    """The rows of each request (in row order) that runs with a LoRA adapter."""
    rows, first = [], 0
    for request, count in zip(reqs, counts, strict=True):
        if request.lora_request is not None:
            rows.append((request.lora_request, first, count))
        first += count
    return rows


class InputPreparer:
    """Builds `ModelInputs` for one device and attention backend.

    Args:
        block_size: tokens per KV block.
        device: where the tensors go.
        backend: builds the attention metadata, and says which rows its batched call takes.
    """

    def __init__(self, block_size: int, device: torch.device, backend: AttentionBackend) -> None:
        self.block_size = block_size
        self.device = device
        self.backend = backend
        self.num_kv_groups = 1  # NOTE: 2 for a mixed model's sliding-window group (kv_cache_manager.py)

    def prepare(self, out: SchedulerOutput) -> tuple[list[Request], ModelInputs]:
        """The requests that sample (in row order) and the step's inputs."""
        order = sorted(range(len(out.requests)),
                       key=lambda i: not self.backend.batched(out.num_scheduled_tokens[i]))
        reqs = [out.requests[i] for i in order]
        counts = [out.num_scheduled_tokens[i] for i in order]
        input_ids, positions, meta, sample_rows = self._prepare(reqs, counts, [out.drafts(r) for r in reqs])
        rows = [r for _, first, last in sample_rows for r in range(first, last + 1)]
        prompt_rows, scored_rows = self._spans(out, order, positions_to_score, PromptRows)
        pool_rows, pooled_rows = self._spans(out, order, positions_to_pool, PoolRows)
        inputs = ModelInputs(input_ids, positions, meta,
                             torch.tensor(rows + scored_rows, dtype=torch.long, device=self.device),
                             sum(counts), prompt_rows, pool_rows,
                             torch.tensor(pooled_rows, dtype=torch.long, device=self.device),
                             lora_rows(reqs, counts))
        return [reqs[i] for i, _, _ in sample_rows], inputs

    @staticmethod
    def _spans(out: SchedulerOutput, order: list[int], positions: Callable[[Request, int], tuple[int, int]],
               span_type: Callable[[int, int, int], Span]) -> tuple[list[Span], list[int]]:
        """The prompt positions each request scores (prompt logprobs) or pools, as spans
        (`span_type`), and their hidden rows."""
        spans: list[Span] = []
        rows: list[int] = []
        base = 0
        for i in order:
            request, n = out.requests[i], out.num_scheduled_tokens[i]
            start, count = positions(request, n)
            if count:
                spans.append(span_type(i, start, count))
                first = base + start - request.num_computed_tokens
                rows.extend(range(first, first + count))
            base += n
        return spans, rows

    def _slot(self, request: Request, pos: int) -> int:
        return request.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def _group_meta(self, reqs: list[Request], counts: list[int],
                    meta: NativeAttentionMetadata | TorchAttentionMetadata) -> AttentionMetadata:
        """With a sliding-window group, both groups' metadata (`GroupedAttentionMetadata`)."""
        if self.num_kv_groups == 1:
            return meta
        bs = self.block_size
        slots = [group_block_ids(r, 1)[p // bs] * bs + p % bs
                 for r, n in zip(reqs, counts, strict=True)
                 for p in range(r.num_computed_tokens, r.num_computed_tokens + n)]
        sliding = self.backend.build(reqs, counts, self._tensor(slots), group=1)
        return GroupedAttentionMetadata([meta, sliding])

    def _prepare(self, reqs: list[Request], counts: list[int], drafts: list[list[int]]):
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[tuple[int, int, int]] = []  # (request, first row, last row)
        for i, (r, n, draft) in enumerate(zip(reqs, counts, drafts, strict=True)):
            c = r.num_computed_tokens
            tokens = r.token_ids_between(c, c + n)
            if len(tokens) < n:  # NOTE: the drafts follow the real tokens
                tokens = tokens + draft[:n - len(tokens)]
            input_ids.extend(tokens)
            positions.extend(range(c, c + n))
            slots.extend(self._slot(r, p) for p in range(c, c + n))
            if c + n >= r.num_tokens and r.pooling_params is None:
                last = len(input_ids) - 1
                sample_rows.append((i, last - len(draft), last))
        meta = self._group_meta(reqs, counts, self.backend.build(reqs, counts, self._tensor(slots)))
        return self._tensor(input_ids), self._tensor(positions), meta, sample_rows

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)
