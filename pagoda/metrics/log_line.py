"""The periodic stats line: vLLM's `Engine 000: Avg prompt throughput: ...` log.

Token counts accumulate between `log()` calls; each call turns them into throughputs over the
elapsed time and starts a new interval. Idle intervals (no tokens, no preemptions, nothing
running or waiting) log at DEBUG so an idle server stays quiet; all others at INFO.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pagoda.metrics.base import StatLoggerBase, increase
from pagoda.stats import IterationStats, SchedulerStats

logger = logging.getLogger("pagoda")

LOG_FORMAT = ("Engine %03d: Avg prompt throughput: %.1f tokens/s, "
              "Avg generation throughput: %.1f tokens/s, Running: %d reqs, Waiting: %d reqs, "
              "Preemptions: %d, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%")


class LoggingStatLogger(StatLoggerBase):
    """Logs one stats line per `log()` call to the "pagoda" logger.

    Args:
        engine_index: printed as `Engine 000`.
        clock: monotonic seconds; injectable for tests.
    """

    def __init__(self, engine_index: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine_index = engine_index
        self._clock = clock
        self._last_scheduler_stats = SchedulerStats()
        self._prefix_hit_rate = 0.0
        self._last_prefix_totals = (0, 0)
        self._reset(clock())

    def _reset(self, now: float) -> None:
        self._last_log_time = now
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def record(self, scheduler_stats: SchedulerStats | None,
               iteration_stats: IterationStats | None) -> None:
        if iteration_stats is not None:
            self.num_prompt_tokens += iteration_stats.num_prompt_tokens
            self.num_generation_tokens += iteration_stats.num_generation_tokens
            self.num_preemptions += iteration_stats.num_preemptions
            spec = iteration_stats.spec_decoding
            if spec is not None:
                self.num_draft_tokens += spec.num_draft_tokens
                self.num_accepted_tokens += spec.num_accepted_tokens
        if scheduler_stats is not None:
            # NOTE: the prefix cache figures are running totals; the interval wants the increase.
            last_queries, last_hits = self._last_prefix_totals
            self.prefix_cache_queries += increase(scheduler_stats.prefix_cache_queries, last_queries)
            self.prefix_cache_hits += increase(scheduler_stats.prefix_cache_hits, last_hits)
            self._last_prefix_totals = (scheduler_stats.prefix_cache_queries,
                                        scheduler_stats.prefix_cache_hits)
            self._last_scheduler_stats = scheduler_stats

    def log(self) -> None:
        now = self._clock()
        elapsed = now - self._last_log_time
        prompt_tps = self.num_prompt_tokens / elapsed if elapsed > 0 else 0.0
        generation_tps = self.num_generation_tokens / elapsed if elapsed > 0 else 0.0
        # NOTE: with no lookups in this interval, the last measured hit rate still describes
        # the cache better than 0% would.
        if self.prefix_cache_queries:
            self._prefix_hit_rate = self.prefix_cache_hits / self.prefix_cache_queries
        sched = self._last_scheduler_stats
        busy = (self.num_prompt_tokens or self.num_generation_tokens or self.num_preemptions
                or sched.num_running_reqs or sched.num_waiting_reqs)
        line = LOG_FORMAT % (self.engine_index, prompt_tps, generation_tps,
                             sched.num_running_reqs, sched.num_waiting_reqs, self.num_preemptions,
                             sched.kv_cache_usage * 100, self._prefix_hit_rate * 100)
        if self.num_draft_tokens:
            line += (f", Draft acceptance rate: "
                     f"{100 * self.num_accepted_tokens / self.num_draft_tokens:.1f}%")
        logger.log(logging.INFO if busy else logging.DEBUG, "%s", line)
        self._reset(now)
