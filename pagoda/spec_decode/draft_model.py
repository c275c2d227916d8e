"""Drafting with a second, smaller model (same tokenizer), greedily.

The draft model has its own runner and KV pool. Each target request gets a shadow sequence
in that pool holding the same tokens. A proposal step first brings the shadow up to the
target's tokens (computing the KV it lacks, in one chunk, and drafting the first token from
it), then runs `k - 1` one-token steps for all requests together. The drafted tokens are
not kept in the shadow: next time, its computed KV is cut back to the prefix it shares with
the target (the verification may have rejected some drafts), so only matching KV is reused.
The drafted tokens stay in the shadow's token list until then: the shared prefix is exactly
the KV that is still right.

Invariants: a shadow's `num_computed_tokens` never exceeds the prefix its tokens share with
the target's; shadows of finished, aborted or preempted targets are freed.
"""

from __future__ import annotations

import dataclasses
import logging

from pagoda.block_manager import BlockManager
from pagoda.config import EngineConfig, SpeculativeConfig
from pagoda.request import Request, RequestStatus
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler import SchedulerOutput
from pagoda.spec_decode.eligibility import draft_limit

logger = logging.getLogger("pagoda")


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftModelProposer:
    """Proposes greedy drafts from a smaller model for every eligible request."""

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig,
                 target_vocab_size: int) -> None:
        from pagoda.executor import build_engine_parts

        assert spec.model is not None
        quantization = spec.quantization if spec.quantization is not None else config.model.quantization
        draft_config = dataclasses.replace(
            config, model=dataclasses.replace(config.model, model=spec.model, quantization=quantization),
            # NOTE: the draft's shadow sequences hold one table (one KV cache group).
            cache=dataclasses.replace(config.cache, enable_prefix_caching=False,
                                      disable_hybrid_kv_cache_manager=True),
            speculative=None)
        parts = build_engine_parts(draft_config)
        self.runner = parts.runner
        self.num_tokens = spec.num_speculative_tokens
        self.max_model_len = config.scheduler.max_model_len
        self.block_manager = BlockManager(parts.num_blocks, config.cache.block_size, False)
        vocab_size = parts.vocab_size
        if vocab_size != target_vocab_size:
            raise ValueError(f"The draft model's vocabulary ({vocab_size}) differs from the "
                             f"target's ({target_vocab_size}); it must share the tokenizer.")
        self.shadows: dict[Request, Request] = {}
        self._params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
        logger.info("Draft model %s (%s): %d speculative tokens, %d KV blocks", spec.model,
                    quantization or config.model.dtype, self.num_tokens, parts.num_blocks)

    def propose(self, requests: list[Request]) -> dict[Request, list[int]]:
        self._free_stale()
        limits = {r: draft_limit(r, self.num_tokens) for r in requests}
        active = [r for r in requests if limits[r] > 0]
        drafts: dict[Request, list[int]] = {r: [] for r in active}
        for request in active:
            self._sync(request)
        steps = max((limits[r] for r in active), default=0)
        for step in range(steps):
            batch = [r for r in active if len(drafts[r]) < limits[r]]
            if not batch:
                break
            drafted = self._step([self.shadows[r] for r in batch], first=step == 0)
            for request, token in zip(batch, drafted, strict=True):
                if token is None:
                    active.remove(request)
                else:
                    drafts[request].append(token)
        return {r: tokens for r, tokens in drafts.items() if tokens}

    def _sync(self, target: Request) -> None:
        """Points the shadow at the target's tokens, keeping only the KV they share."""
        shadow = self.shadows.get(target)
        if shadow is None:
            shadow = Request(f"draft-{target.request_id}", target.all_token_ids, self._params,
                             max_model_len=self.max_model_len)
            shadow.status = RequestStatus.RUNNING
            self.shadows[target] = shadow
        shared = _shared_prefix(shadow.all_token_ids, target.all_token_ids)
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, shared,
                                         target.num_tokens - 1)
        shadow.all_token_ids = list(target.all_token_ids)

    def _step(self, shadows: list[Request], first: bool) -> list[int | None]:
        """One draft forward for `shadows`; each gets one token (None: no room in the pool)."""
        out = SchedulerOutput()
        for shadow in shadows:
            num_new = shadow.num_tokens - shadow.num_computed_tokens
            if self.block_manager.allocate_slots(shadow, num_new):
                out.add(shadow, num_new)
        if not out.requests:
            return [None] * len(shadows)
        sampled, result = self.runner.execute(out)
        tokens = {r: t for r, t in zip(sampled, result.token_ids, strict=True)} if result else {}
        for shadow, num_new in zip(out.requests, out.num_scheduled_tokens, strict=True):
            shadow.num_computed_tokens += num_new
            if shadow in tokens:
                shadow.all_token_ids.append(tokens[shadow])
        return [tokens.get(s) for s in shadows]

    def _free_stale(self) -> None:
        for target in [t for t in self.shadows if t.status is not RequestStatus.RUNNING]:
            self.block_manager.free(self.shadows.pop(target))
