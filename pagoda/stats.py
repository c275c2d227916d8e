"""Stats as plain data: what the engine reports after each step.

The engine fills these; loggers (`metrics.py`: Prometheus and the periodic log line) read
them. Nothing here imports a metrics library.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SchedulerStats:
    """A snapshot of the scheduler and the KV pool after a step."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_blocks_total: int = 0
    num_blocks_free: int = 0
    num_blocks_cached: int = 0
    num_tokens_held: int = 0
    num_slots_reserved: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_blocks_touched: int = 0
    # NOTE: a mixed model's sliding-window group (kv_cache_manager.py); the fields above are
    # then its full-attention group's.
    num_sliding_blocks_total: int = 0
    num_sliding_blocks_free: int = 0


@dataclass
class FinishedRequestStats:
    """Per-request figures, reported once when a request finishes (or is aborted/failed)."""

    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens_param: int | None
    e2e_latency: float
    queue_time: float
    prefill_time: float
    decode_time: float
    inference_time: float
    mean_time_per_output_token: float
    num_cached_tokens: int = 0
    # NOTE: with a watermark configured: "watermarked", "skipped" (asked, but greedy) or
    # "not_watermarked" (it said `watermarking: false`); None without one
    watermark_status: str | None = None


@dataclass
class IterationStats:
    """What one engine step did."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    num_scheduled_tokens: int = 0
    step_duration: float = 0.0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    failed_requests: dict[str, int] = field(default_factory=dict)
    rejected_requests: dict[str, int] = field(default_factory=dict)
    spec_decoding: SpecDecodingStats | None = None

    def add_request_records(self, other: IterationStats) -> None:
        """Adds the requests `other` saw finish, fail or be refused (what a call outside a
        step, such as a stop string's, records) to this step's."""
        self.finished_requests += other.finished_requests
        for mine, theirs in ((self.failed_requests, other.failed_requests),
                             (self.rejected_requests, other.rejected_requests)):
            for reason, count in theirs.items():
                mine[reason] = mine.get(reason, 0) + count


@dataclass
class SpecDecodingStats:
    """One step's speculative decoding: drafts proposed and how many tokens were accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.num_accepted_tokens_per_pos) < num_draft_tokens:
            self.num_accepted_tokens_per_pos += [0] * (
                num_draft_tokens - len(self.num_accepted_tokens_per_pos))
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1


@dataclass(frozen=True)
class EngineInfo:
    """What the engine was built with, given once to each stat logger (an info metric).

    `linear_kernels` is the kernel plan of the model's largest bf16 linear ("rows 1+ gemm";
    "" without one), `kernel_plan_source` where it came from (measured, cached, forced),
    `decoder` how decode steps run the decoder layers on the CPU ("native stack", or "layer by
    layer: " and why; "" off the CPU kernels).
    """

    kernel_variant: str
    linear_kernels: str
    kernel_plan_source: str
    decoder: str = ""
