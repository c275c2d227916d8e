"""Turning a step's scheduled requests into the model's input tensors.

`InputPreparer.prepare` orders the batch (the rows one batched kernel call attends first: with
the native CPU kernel every row, otherwise the one-token decodes; then prefill chunks, one
SDPA call each), flattens it without padding,
and builds `input_ids`, `positions`, `slot_mapping`, the `AttentionMetadata` and the rows
whose logits are needed (sampling rows, then the prompt rows of requests that ask for
prompt logprobs). The result, `ModelInputs`, holds only tensors and plain data: the
model runner consumes it in-process, and the parallel executor ships it to its workers.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from pagoda.layers.attention import AttentionMetadata, PrefillChunk
from pagoda.prompt_logprobs import PromptRows, positions_to_score
from pagoda.request import Request
from pagoda.scheduler import SchedulerOutput


@dataclass
class ModelInputs:
    """One step's model inputs; `logits_rows` index the hidden rows to project to logits:
    first the sampling rows, then the prompt positions `prompt_rows` score. `sample_argmax`:
    the parallel workers return the sampling rows' argmax token ids, not their logits (every
    row samples greedily and plainly: `sampler.argmax_suffices`)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor
    num_tokens: int
    prompt_rows: list[PromptRows] = field(default_factory=list)
    sample_argmax: bool = False

    @property
    def num_sample_rows(self) -> int:
        return self.logits_rows.numel() - sum(span.count for span in self.prompt_rows)


class InputPreparer:
    """Builds `ModelInputs` for one device and attention path.

    Args:
        block_size: tokens per KV block.
        device: where the tensors go.
        native: the native CPU kernels attend (several query rows per sequence allowed).

    Masks are causal; each attention layer narrows them to its own sliding window.
    """

    def __init__(self, block_size: int, device: torch.device, native: bool) -> None:
        self.block_size = block_size
        self.device = device
        self.native = native

    def prepare(self, out: SchedulerOutput) -> tuple[list[Request], ModelInputs]:
        """The requests that sample (in row order) and the step's inputs."""
        order = sorted(range(len(out.requests)),
                       key=lambda i: not self._in_decode_group(out.requests[i],
                                                               out.num_scheduled_tokens[i]))
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

    def _in_decode_group(self, request: Request, num_tokens: int) -> bool:
        """Attended in the batched kernel call: with the native kernel (any number of query rows
        per sequence: decodes, verified drafts, prefill chunks over a cached prefix) every
        request; otherwise one new token."""
        return self.native or num_tokens == 1

    def _slot(self, request: Request, pos: int) -> int:
        return request.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def _prepare(self, reqs: list[Request], counts: list[int], drafts: list[list[int]]):
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[tuple[int, int, int]] = []  # (request, first row, last row)
        for i, (r, n, draft) in enumerate(zip(reqs, counts, drafts, strict=True)):
            c = r.num_computed_tokens
            tokens = r.all_token_ids[c:c + n]
            if len(tokens) < n:  # NOTE: the drafts follow the real tokens
                tokens = tokens + draft[:n - len(tokens)]
            input_ids.extend(tokens)
            positions.extend(range(c, c + n))
            slots.extend(self._slot(r, p) for p in range(c, c + n))
            if c + n >= r.num_tokens:
                last = len(input_ids) - 1
                sample_rows.append((i, last - len(draft), last))
        num_decode_reqs = sum(1 for r, n in zip(reqs, counts, strict=True)
                              if self._in_decode_group(r, n))
        num_decodes = sum(counts[:num_decode_reqs])
        meta = AttentionMetadata(slot_mapping=self._tensor(slots), num_decode_tokens=num_decodes)
        group, group_counts = reqs[:num_decode_reqs], counts[:num_decode_reqs]
        if num_decodes and self.native:
            meta.decode_block_tables, meta.decode_seq_lens = self._kernel_tables(group, group_counts)
            meta.decode_query_start_loc = torch.tensor([0, *itertools.accumulate(group_counts)])
        elif num_decodes:
            meta.decode_slots, meta.decode_mask, meta.decode_seq_lens = self._decode_tables(group)
        start = num_decodes
        for r, n in zip(reqs[num_decode_reqs:], counts[num_decode_reqs:], strict=True):
            meta.prefills.append(self._prefill_chunk(r, start, n))
            start += n
        return self._tensor(input_ids), self._tensor(positions), meta, sample_rows

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

    def _block_table(self, reqs: list[Request], num_blocks: int) -> torch.Tensor:
        rows = [r.block_ids[:num_blocks] + [0] * (num_blocks - len(r.block_ids[:num_blocks])) for r in reqs]
        return torch.tensor(rows, dtype=torch.long)

    def _gather_index(self, table: torch.Tensor, length: int) -> torch.Tensor:
        pos = torch.arange(length)
        return table[:, pos // self.block_size] * self.block_size + pos % self.block_size

    def _kernel_tables(self, reqs: list[Request], counts: list[int]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        lens = [r.num_computed_tokens + n for r, n in zip(reqs, counts, strict=True)]
        table = self._block_table(reqs, -(-max(lens) // self.block_size))
        return table, torch.tensor(lens, dtype=torch.long)

    def _decode_tables(self, reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The gather index, causal mask and context lengths of one-token decodes."""
        ctx = torch.tensor([r.num_computed_tokens + 1 for r in reqs])
        length = int(ctx.max())
        table = self._block_table(reqs, -(-length // self.block_size))
        index = self._gather_index(table, length)
        mask = torch.arange(length)[None, :] < ctx[:, None]
        return index.to(self.device), mask[:, None, None, :].to(self.device), ctx.to(self.device)

    def _prefill_chunk(self, r: Request, start: int, n: int) -> PrefillChunk:
        c = r.num_computed_tokens
        if c == 0:
            return PrefillChunk(query_start=start, query_len=n)
        length = c + n
        mask = torch.arange(length)[None, :] <= torch.arange(c, length)[:, None]
        table = self._block_table([r], -(-length // self.block_size))
        return PrefillChunk(query_start=start, query_len=n, mask=mask.to(self.device),
                            slots=self._gather_index(table, length)[0].to(self.device),
                            num_computed_tokens=c)
