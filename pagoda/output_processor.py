"""From the core's new tokens to `RequestOutput` deltas, and per-request stats.

One `RequestState` per user request groups its n samples, each a `SampleState` with its own
copy of the tokens, logprobs and finish reason the core reported (`EngineCoreOutput`) and an
incremental detokenizer. `update` feeds a sample its new tokens and says when a stop string
ended it (the tokens after it are dropped; the engine then stops the core's sequence);
`make_output` turns what changed into delta `CompletionOutput`s. The request's prompt logprobs
(sample 0 scores them) accumulate here chunk by chunk and go out whole, once.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pagoda.detokenizer import IncrementalDetokenizer
from pagoda.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput
from pagoda.request import Request, RequestStatus
from pagoda.sampler import TokenLogprobs
from pagoda.sampling_params import SamplingParams
from pagoda.stats import FinishedRequestStats, IterationStats

if TYPE_CHECKING:
    from pagoda.engine_core import EngineCoreOutput


class SampleState:
    """One sample as the API sees it."""

    def __init__(self, index: int, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer: object | None, stream_interval: int = 1) -> None:
        self.index = index
        self.params = params
        self.stream_interval = stream_interval
        self.tokenizer = tokenizer
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params)
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.num_cached_tokens = 0
        self.num_emitted_tokens = 0
        self.num_emitted_logprobs = 0
        self.reported = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, out: EngineCoreOutput) -> bool:
        """Takes the core's news for this sample; True when a stop string ended it (the new
        tokens after the one that completed it are dropped)."""
        self.num_cached_tokens = out.num_cached_tokens
        if self.finished:
            return False
        for i, token in enumerate(out.new_token_ids):
            self.token_ids.append(token)
            if out.new_logprobs is not None:
                entry = out.new_logprobs[i]
                self.logprobs.append(entry)
                self.cumulative_logprob += entry[token][0]
            if self.detok.add_token(token):
                self.finish_reason, self.stop_reason = "stop", self.detok.stop_reason
                return True
        if out.finish_reason is not None:
            self.finish_reason = _finish_reason(out.finish_reason)
            self.stop_reason = out.stop_reason
        return False

    def delta(self) -> CompletionOutput | None:
        """What changed since the last delta; None while nothing did, or while fewer than
        `stream_interval` new tokens wait after the first delta (vLLM's stream interval)."""
        finished = self.finished
        pending = len(self.token_ids) - self.num_emitted_tokens
        if pending == 0 and not (finished and not self.reported):
            return None
        if not finished and self.num_emitted_tokens and pending < self.stream_interval:
            return None
        tokens = self.token_ids[self.num_emitted_tokens:]
        self.num_emitted_tokens = len(self.token_ids)
        self.reported = self.reported or finished
        return CompletionOutput(
            index=self.index, text=self.detok.take_delta(finished), token_ids=tokens,
            logprobs=self._logprob_delta(), cumulative_logprob=self.cumulative_logprob if self.logprobs else None,
            finish_reason=self.finish_reason, stop_reason=self.stop_reason,
        )

    def _logprob_delta(self) -> list[dict[int, Logprob]] | None:
        if self.params.logprobs is None:
            return None
        new = self.logprobs[self.num_emitted_logprobs:]
        self.num_emitted_logprobs = len(self.logprobs)
        return [self._to_logprobs(entry) for entry in new]

    def _to_logprobs(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        return to_logprobs(entry, self.tokenizer)


def to_logprobs(entry: TokenLogprobs, tokenizer: object | None) -> dict[int, Logprob]:
    """The core's (logprob, rank) per token id as `Logprob`s with their decoded text."""
    decode = getattr(tokenizer, "decode", None)
    return {t: Logprob(t, lp, rank, decode([t]) if decode else None) for t, (lp, rank) in entry.items()}


def _finish_reason(status: RequestStatus) -> str:
    return {"stop": "stop", "length": "length", "abort": "abort", "error": "error",
            "repetition": "repetition"}[status.value]


class RequestState:
    """A user request: prompt, its samples, and whether all have been reported finished."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: list[SamplingParams], metrics: RequestMetrics, tokenizer: object | None,
                 stream_interval: int = 1) -> None:
        """`stream_interval`: the engine's (each request's own may raise it for itself)."""
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.metrics = metrics
        self.samples = [SampleState(i, prompt_token_ids, p, tokenizer,
                                    max(p.stream_interval or 1, stream_interval))
                        for i, p in enumerate(params)]
        self.tokenizer = tokenizer
        # NOTE: vLLM's shape: None for the first prompt token, which nothing predicts.
        self.prompt_logprobs: PromptLogprobs | None = (
            [None] if params[0].prompt_logprobs is not None else None)
        self.prompt_logprobs_sent = False
        self.error: str | None = None
        self.error_is_request = False  # the request's own fault (its constraint), not the engine's
        self.pooled: list[float] | None = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    def update(self, out: EngineCoreOutput) -> bool:
        """Feeds one sample its news (see `SampleState.update`)."""
        if out.error is not None and self.error is None:
            self.error, self.error_is_request = out.error, out.error_is_request
        if out.sample_index == 0 and out.metrics is not None:
            # NOTE: the core's own object in process; a fresh copy when it runs apart.
            self.metrics = out.metrics
        if out.new_prompt_logprobs and self.prompt_logprobs is not None:
            self.prompt_logprobs += [to_logprobs(e, self.tokenizer) for e in out.new_prompt_logprobs]
        if out.pooled is not None:
            self.pooled = out.pooled
        return self.samples[out.sample_index].update(out)

    def fail(self, error: str) -> None:
        """Ends every sample still open with `error` (a failure on the frontend's side)."""
        self.error = self.error or error
        for sample in self.samples:
            if not sample.finished:
                sample.finish_reason = "error"

    def make_output(self) -> RequestOutput | None:
        deltas = [d for s in self.samples if (d := s.delta()) is not None]
        if not deltas:
            return None
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
            outputs=deltas, finished=self.finished, metrics=self.metrics,
            num_cached_tokens=max(s.num_cached_tokens for s in self.samples), error=self.error,
            error_is_request=self.error_is_request, prompt_logprobs=self._take_prompt_logprobs(),
            pooled=self.pooled,
        )

    def _take_prompt_logprobs(self) -> PromptLogprobs | None:
        """The whole prompt's logprobs, once, as soon as every position is scored."""
        lps = self.prompt_logprobs
        if lps is None or self.prompt_logprobs_sent or len(lps) < len(self.prompt_token_ids):
            return None
        self.prompt_logprobs_sent = True
        return lps


def record_token_timing(request: Request, now: float, stats: IterationStats) -> None:
    m = request.metrics
    if m.first_token_time is None:
        m.first_token_time = now
        stats.time_to_first_tokens.append(now - m.arrival_time)
        stats.num_prompt_tokens += request.num_prompt_tokens
    elif m.last_token_time is not None:
        stats.inter_token_latencies.append(now - m.last_token_time)
    m.last_token_time = now
    stats.num_generation_tokens += 1


def finished_stats(request: Request) -> FinishedRequestStats:
    """The per-request figures of a finished, aborted or failed request."""
    m = request.metrics
    now = m.finished_time or time.time()
    scheduled = m.first_scheduled_time or now
    first = m.first_token_time or now
    n_out = request.num_output_tokens
    return FinishedRequestStats(
        finish_reason=_finish_reason(request.status), num_prompt_tokens=request.num_prompt_tokens,
        num_generation_tokens=n_out, max_tokens_param=request.sampling_params.max_tokens,
        e2e_latency=now - m.arrival_time, queue_time=scheduled - m.arrival_time,
        prefill_time=first - scheduled, decode_time=now - first, inference_time=now - scheduled,
        mean_time_per_output_token=(now - first) / (n_out - 1) if n_out > 1 else 0.0,
        num_cached_tokens=request.num_cached_tokens,
        watermark_status=request.sampling_params.watermark_status,
    )
