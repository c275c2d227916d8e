"""Turning a step's scheduled requests into the model's input tensors.

`InputPreparer.prepare` orders the batch (first the rows the attention backend's batched call
takes: with the native CPU kernels every row, with torch's SDPA the one-token decodes; then
the rest), flattens it without padding, and builds `input_ids`, `positions`, `slot_mapping`,
the attention metadata (built by the backend, attention_backend.py) and the rows
whose logits are needed (sampling rows, then the prompt rows of requests that ask for
prompt logprobs). The result, `ModelInputs`, holds only tensors and plain data; every
parallel worker prepares its own from the step's `WorkerRequest` copies (worker_step.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagoda.layers.attention_backend import AttentionBackend, AttentionMetadata
from pagoda.prompt_logprobs import PromptRows, positions_to_score
from pagoda.request import Request
from pagoda.scheduler import SchedulerOutput


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

    @property
    def num_sample_rows(self) -> int:
        return self.logits_rows.numel() - sum(span.count for span in self.prompt_rows)


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

    def prepare(self, out: SchedulerOutput) -> tuple[list[Request], ModelInputs]:
        """The requests that sample (in row order) and the step's inputs."""
        order = sorted(range(len(out.requests)),
                       key=lambda i: not self.backend.batched(out.num_scheduled_tokens[i]))
        reqs = [out.requests[i] for i in order]
        counts = [out.num_scheduled_tokens[i] for i in order]
        input_ids, positions, meta, sample_rows = self._prepare(reqs, counts, [out.drafts(r) for r in reqs])
        rows = [r for _, first, last in sample_rows for r in range(first, last + 1)]
        prompt_rows, scored_rows = self._prompt_rows(out, order)
        inputs = ModelInputs(input_ids, positions, meta,
                             torch.tensor(rows + scored_rows, dtype=torch.long, device=self.device),
                             sum(counts), prompt_rows)
        return [reqs[i] for i, _, _ in sample_rows], inputs

    @staticmethod
    def _prompt_rows(out: SchedulerOutput, order: list[int]) -> tuple[list[PromptRows], list[int]]:
        """The prompt positions each request scores (prompt logprobs) and their hidden rows."""
        spans: list[PromptRows] = []
        rows: list[int] = []
        base = 0
        for i in order:
            request, n = out.requests[i], out.num_scheduled_tokens[i]
            start, count = positions_to_score(request, n)
            if count:
                spans.append(PromptRows(i, start, count))
                first = base + start - request.num_computed_tokens
                rows.extend(range(first, first + count))
            base += n
        return spans, rows

    def _slot(self, request: Request, pos: int) -> int:
        return request.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

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
            if c + n >= r.num_tokens:
                last = len(input_ids) - 1
                sample_rows.append((i, last - len(draft), last))
        meta = self.backend.build(reqs, counts, self._tensor(slots))
        return self._tensor(input_ids), self._tensor(positions), meta, sample_rows

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)
