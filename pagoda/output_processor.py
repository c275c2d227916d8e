"""From sampled tokens to `RequestOutput` deltas and per-request stats.

One `RequestState` per user request groups its n samples (child `Request`s), each with an
incremental detokenizer. After a step it turns the children's new tokens into delta
`CompletionOutput`s, applies stop strings, and records timings for the stats.
"""

from __future__ import annotations

import time

from pagoda.detokenizer import IncrementalDetokenizer
from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
from pagoda.request import Request, RequestStatus
from pagoda.sampler import TokenLogprobs
from pagoda.stats import FinishedRequestStats, IterationStats


class SampleState:
    """One child sequence as the API sees it."""

    def __init__(self, index: int, request: Request, tokenizer: object | None) -> None:
        self.index = index
        self.request = request
        self.tokenizer = tokenizer
        self.detok = IncrementalDetokenizer(tokenizer, request.prompt_token_ids, request.sampling_params)
        self.num_emitted_tokens = 0
        self.num_emitted_logprobs = 0
        self.reported = False

    def add_token(self, token_id: int) -> bool:
        return self.detok.add_token(token_id)

    def delta(self) -> CompletionOutput | None:
        r = self.request
        finished = r.is_finished
        if self.num_emitted_tokens == r.num_output_tokens and not (finished and not self.reported):
            return None
        tokens = r.output_token_ids[self.num_emitted_tokens:]
        self.num_emitted_tokens = r.num_output_tokens
        self.reported = self.reported or finished
        return CompletionOutput(
            index=self.index, text=self.detok.take_delta(finished), token_ids=tokens,
            logprobs=self._logprob_delta(), cumulative_logprob=r.cumulative_logprob if r.logprobs else None,
            finish_reason=_finish_reason(r.status) if finished else None,
            stop_reason=r.stop_reason,
        )

    def _logprob_delta(self) -> list[dict[int, Logprob]] | None:
        r = self.request
        if r.sampling_params.logprobs is None:
            return None
        new = r.logprobs[self.num_emitted_logprobs:]
        self.num_emitted_logprobs = len(r.logprobs)
        return [self._to_logprobs(entry) for entry in new]

    def _to_logprobs(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        decode = getattr(self.tokenizer, "decode", None)
        return {t: Logprob(t, lp, rank, decode([t]) if decode else None) for t, (lp, rank) in entry.items()}


def _finish_reason(status: RequestStatus) -> str:
    return {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}[status.value]


class RequestState:
    """A user request: prompt, its samples, and whether all have been reported finished."""

    def __init__(self, request_id: str, prompt: str | None, children: list[Request], tokenizer: object | None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.samples = [SampleState(i, c, tokenizer) for i, c in enumerate(children)]
        self.error: str | None = None
        self.error_is_request = False  # the request's own fault (its constraint), not the engine's

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.samples)

    def make_output(self) -> RequestOutput | None:
        deltas = [d for s in self.samples if (d := s.delta()) is not None]
        if not deltas:
            return None
        first = self.samples[0].request
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=first.prompt_token_ids,
            outputs=deltas, finished=self.finished, metrics=first.metrics,
            num_cached_tokens=max(s.request.num_cached_tokens for s in self.samples), error=self.error,
            error_is_request=self.error_is_request,
        )


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
    )
