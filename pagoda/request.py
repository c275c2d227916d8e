"""Request: the engine's state of one sequence being generated.

Invariants: `num_computed_tokens <= num_tokens`; the KV of the first `num_computed_tokens`
tokens lives in the blocks `block_ids` (owned by the block manager; a mixed model's
sliding-window layers keep theirs in `sliding_block_ids`); a token is sampled only
in a step after which every token is computed.
"""

from __future__ import annotations

import enum
import time

import torch

from pagoda.lora import LoRARequest
from pagoda.outputs import RequestMetrics
from pagoda.pooling import PoolingParams
from pagoda.sampling_params import SamplingParams
from pagoda.structured_output import Grammar
from pagoda.watermark import ContextHistory


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"
    FINISHED_REPETITION = "repetition"  # NOTE: vLLM's: `repetition_detection` found a loop

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error", "repetition")


class Request:
    """One sequence: prompt, output so far, progress of its KV computation."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: set[int] | None = None,
        arrival_time: float | None = None,
        max_model_len: int | None = None,
        sample_index: int = 0,
        grammar: Grammar | None = None,
        priority: int = 0,
        group: str | None = None,
        pooling_params: PoolingParams | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        watermark: ContextHistory | None = None,
    ) -> None:
        self.request_id = request_id
        self.sample_index = sample_index
        self.priority = priority  # NOTE: vLLM's meaning: lower is served first ("priority" policy)
        self.group = request_id if group is None else group  # what one client asked at once
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        self.eos_token_ids = eos_token_ids or set()
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_ids: list[int] = []
        # NOTE: a mixed model's sliding-window layers' table (kv_cache_manager.py); blocks that
        # left the window are NULL_BLOCK.
        self.sliding_block_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        self.cache_salt = cache_salt  # NOTE: hashed into the first block's name (block_manager.py)
        self.lora_request = lora_request  # NOTE: the adapter its rows run with (lora.py); named in its blocks too
        self.status = RequestStatus.WAITING
        self.stop_reason: str | int | None = None
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.time())
        self.max_tokens = self._max_tokens(max_model_len)
        self.generator = self._make_generator()
        self.grammar = grammar
        self.watermark = watermark  # NOTE: its watermark's context history (watermark.py), if it carries one
        # NOTE: prompt positions whose logprobs were reported (prompt_logprobs.py); a recompute
        # after preemption does not report them again.
        self.num_prompt_logprobs = 0
        # NOTE: a pooled request (pooling.py) generates nothing; the sum of its pooled rows so
        # far and their count (a recompute after preemption pools none twice).
        self.pooled_sum: torch.Tensor | None = None
        self.num_pooled_tokens = 0

    def _max_tokens(self, max_model_len: int | None) -> int:
        if self.pooling_params is not None:
            return 0
        limit = self.sampling_params.max_tokens
        if max_model_len is not None:
            room = max_model_len - len(self.prompt_token_ids)
            limit = room if limit is None else min(limit, room)
        if limit is None:
            raise ValueError("max_tokens must be set when the context length is unknown.")
        return limit

    def _make_generator(self) -> torch.Generator | None:
        if self.sampling_params.seed is None:
            return None
        gen = torch.Generator()
        gen.manual_seed(self.sampling_params.seed)
        return gen

    @property
    def key(self) -> tuple[str, int]:
        """The sequence's identity: its user request's id and its sample index (n > 1)."""
        return self.request_id, self.sample_index

    @property
    def watermark_context(self) -> tuple[int, ...] | None:
        """The watermark context its next token samples with; None: it samples without one."""
        return self.watermark.next_context(self) if self.watermark is not None else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """The sequence's tokens at positions start .. end - 1."""
        return self.all_token_ids[start:end]

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self) -> RequestStatus | None:
        """The finished status that EOS, stop-token, length and (vLLM's `repetition_detection`,
        past min_tokens) repetition rules give after a token, in vLLM's order."""
        params = self.sampling_params
        token = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                self.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        detection = params.repetition_detection
        if (detection is not None and self.num_output_tokens >= params.min_tokens
                and detection.repeats(self.output_token_ids)):
            self.stop_reason = "repetition_detected"
            return RequestStatus.FINISHED_REPETITION
        return None
