"""ModelRunner: a SchedulerOutput in, sampled tokens out.

It flattens the batch (decodes first, then prefill chunks; no padding to the longest
sequence), builds `input_ids`, `positions`, `slot_mapping` and the `AttentionMetadata`, runs
the model, takes logits only at the rows that sample, and calls the sampler.
"""

from __future__ import annotations

import itertools

import torch

from pagoda.layers import cpu_kernels
from pagoda.layers.attention import AttentionMetadata, PrefillChunk
from pagoda.layers.cpu_kernels.memory import advise_huge_pages
from pagoda.models.llama import LlamaForCausalLM
from pagoda.request import Request
from pagoda.sampler import Sampler, SamplerOutput
from pagoda.scheduler import SchedulerOutput
from pagoda.spec_decode.rejection import verify

SMALL_STEP_TOKENS = 12


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, block_size: int, device: torch.device,
                 sliding_window: int | None = None) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.sliding_window = sliding_window
        self.sampler = Sampler()
        self.use_cpu_kernel = device.type == "cpu" and cpu_kernels.available()
        self.max_threads = torch.get_num_threads()
        cpu_kernels.enable(model, self.use_cpu_kernel)
        if self.use_cpu_kernel:
            cpu_kernels.ops.set_num_threads(self.max_threads)

    def bind_kv_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for attn, (k, v) in zip(self.model.attention_layers(), kv_caches, strict=True):
            attn.k_cache, attn.v_cache = k, v
            if self.use_cpu_kernel:
                advise_huge_pages(k)
                advise_huge_pages(v)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[list[Request], SamplerOutput | None]:
        """Runs one step; returns the requests that sampled and their tokens."""
        self._set_threads(out.total_num_scheduled_tokens)
        order = sorted(range(len(out.requests)),
                       key=lambda i: not self._in_decode_group(out.requests[i],
                                                               out.num_scheduled_tokens[i]))
        reqs = [out.requests[i] for i in order]
        counts = [out.num_scheduled_tokens[i] for i in order]
        input_ids, positions, meta, sample_rows = self._prepare(reqs, counts)
        hidden = self.model(input_ids, positions, meta)
        sampling = [reqs[i] for i, _, _ in sample_rows]
        if not sampling:
            return [], None
        rows = torch.tensor([r for _, first, last in sample_rows for r in range(first, last + 1)],
                            device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        return sampling, self._sample(logits.cpu() if self.device.type != "cpu" else logits,
                                      sampling)

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """Plain rows through the sampler; a request with drafts verifies them on its rows."""
        if not any(r.spec_token_ids for r in requests):
            return self.sampler(logits, requests)
        plain = [i for i, r in enumerate(requests) if not r.spec_token_ids]
        starts, row = [], 0
        for r in requests:
            starts.append(row)
            row += 1 + len(r.spec_token_ids)
        result = self.sampler(logits[[starts[i] for i in plain]], [requests[i] for i in plain])
        tokens: list[list[int]] = [[] for _ in requests]
        for i, token in zip(plain, result.token_ids, strict=True):
            tokens[i] = [token]
        for i, r in enumerate(requests):
            if r.spec_token_ids:
                rows = logits[starts[i]:starts[i] + 1 + len(r.spec_token_ids)].float()
                tokens[i] = verify(rows, r.spec_token_ids, r, self.sampler)
        logprobs: list = [None] * len(requests)
        for i, entry in zip(plain, result.logprobs, strict=True):
            logprobs[i] = entry
        return SamplerOutput([t[0] for t in tokens], logprobs, tokens)

    def _in_decode_group(self, request: Request, num_tokens: int) -> bool:
        """One new token, or (with the native kernel, which takes several query rows per
        sequence) a verification of drafts: attended in the batched decode call."""
        return num_tokens == 1 or (self.use_cpu_kernel and bool(request.spec_token_ids)
                                   and num_tokens == 1 + len(request.spec_token_ids))

    def _set_threads(self, num_tokens: int) -> None:
        # NOTE: with passive OpenMP waits, waking a second thread for each of a small step's
        # ~150 operations costs more than it saves: one thread decoded a single stream 26%
        # faster here, two threads won from about 12 tokens a step (docs/benchmarks.md).
        if self.device.type != "cpu":
            return
        threads = 1 if num_tokens < SMALL_STEP_TOKENS else self.max_threads
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)

    def restore_threads(self) -> None:
        """Gives torch back its full thread count (an offline run ends; others may follow)."""
        if torch.get_num_threads() != self.max_threads:
            torch.set_num_threads(self.max_threads)

    def _slot(self, request: Request, pos: int) -> int:
        return request.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def _prepare(self, reqs: list[Request], counts: list[int]):
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[tuple[int, int, int]] = []  # (request, first row, last row)
        for i, (r, n) in enumerate(zip(reqs, counts, strict=True)):
            c = r.num_computed_tokens
            tokens = r.all_token_ids[c:c + n]
            if len(tokens) < n:  # NOTE: the drafts follow the real tokens
                tokens = tokens + r.spec_token_ids[:n - len(tokens)]
            input_ids.extend(tokens)
            positions.extend(range(c, c + n))
            slots.extend(self._slot(r, p) for p in range(c, c + n))
            if c + n >= r.num_tokens:
                last = len(input_ids) - 1
                sample_rows.append((i, last - len(r.spec_token_ids), last))
        num_decode_reqs = sum(1 for r, n in zip(reqs, counts, strict=True)
                              if self._in_decode_group(r, n))
        num_decodes = sum(counts[:num_decode_reqs])
        meta = AttentionMetadata(slot_mapping=self._tensor(slots), num_decode_tokens=num_decodes,
                                 sliding_window=self.sliding_window or 0)
        group, group_counts = reqs[:num_decode_reqs], counts[:num_decode_reqs]
        if num_decodes and self.use_cpu_kernel:
            meta.decode_block_tables, meta.decode_seq_lens = self._kernel_tables(group, group_counts)
            meta.decode_query_start_loc = torch.tensor([0, *itertools.accumulate(group_counts)])
        elif num_decodes:
            meta.decode_slots, meta.decode_mask = self._decode_tables(group)
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

    def _decode_tables(self, reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        ctx = torch.tensor([r.num_computed_tokens + 1 for r in reqs])
        length = int(ctx.max())
        table = self._block_table(reqs, -(-length // self.block_size))
        index = self._gather_index(table, length)
        pos = torch.arange(length)[None, :]
        mask = pos < ctx[:, None]
        if self.sliding_window is not None:
            mask &= pos > (ctx[:, None] - 1 - self.sliding_window)
        return index.to(self.device), mask[:, None, None, :].to(self.device)

    def _prefill_chunk(self, r: Request, start: int, n: int) -> PrefillChunk:
        c = r.num_computed_tokens
        if c == 0 and self.sliding_window is None:
            return PrefillChunk(query_start=start, query_len=n)
        length = c + n
        q_pos = torch.arange(c, length)[:, None]
        k_pos = torch.arange(length)[None, :]
        mask = k_pos <= q_pos
        if self.sliding_window is not None:
            mask &= k_pos > q_pos - self.sliding_window
        chunk = PrefillChunk(query_start=start, query_len=n, mask=mask.to(self.device))
        if c > 0:
            table = self._block_table([r], -(-length // self.block_size))
            chunk.slots = self._gather_index(table, length)[0].to(self.device)
        return chunk
