"""The engine -> API boundary: what a request produced so far.

`RequestOutput` carries one `CompletionOutput` per parallel sample. The engine emits one per
request per step in which that request changed; `delta` outputs hold only the new tokens and
text (for streaming), cumulative ones hold everything so far (for the offline API).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One candidate token at one position."""

    token_id: int
    logprob: float
    rank: int
    decoded_token: str | None = None


# NOTE: per position, a dict keyed by token id, holding the sampled token and the top-N.
SampleLogprobs = list[dict[int, Logprob]]
# NOTE: vLLM's shape: per prompt position, the prompt token and the top-K; None for the first.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0


@dataclass
class CompletionOutput:
    """One sample of a request.

    finish_reason is None while running, then 'stop' (EOS, stop string or stop token),
    'length' (max_tokens or the context limit) or 'abort'. stop_reason is the matched stop
    string or token id, or None.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request (all of its samples) after a step.

    `prompt_logprobs` (when asked for) comes whole, in the first output after the prompt is
    computed, and is None in the other deltas.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    error_is_request: bool = False  # the error is the request's own (e.g. an unsatisfiable constraint)
    extra: dict[str, object] = field(default_factory=dict)
    prompt_logprobs: PromptLogprobs | None = None
    pooled: list[float] | None = None  # a pooled request's vector (pooling.py), when finished


@dataclass
class PoolingOutput:
    """vLLM's: the pooled vector."""

    data: list[float]


@dataclass
class EmbeddingOutput:
    """vLLM's: the embedding and its size."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class PoolingRequestOutput:
    """vLLM's result of `LLM.encode` (`outputs`: a `PoolingOutput`) and, with an
    `EmbeddingOutput`, of `LLM.embed` (vLLM's `EmbeddingRequestOutput`)."""

    request_id: str
    outputs: PoolingOutput | EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


EmbeddingRequestOutput = PoolingRequestOutput
