"""Live stats: rolling windows of what the engine did lately, for the web page's panel.

`LiveStatLogger` is a stat logger like the others: the engine thread calls `record()` after
every step. It keeps the latest scheduler snapshot (running, waiting, KV cache usage) and,
for the last `window_s` seconds (60 by default), the TTFT and inter-token latency samples,
the prompt and generation token counts and the prefix-cache lookups. `snapshot()` turns
them into one JSON-ready dict (the server's `GET /stats`); it is called from the HTTP thread.

Invariants: every field is touched only under `_lock`; `record()` only appends and prunes
(amortised O(1) a sample), and the sorting for percentiles happens in `snapshot()`, on
copies, outside the lock, so a reader never holds up a step for long. Throughputs are over the
last `rate_window_s` seconds (10 by default), so they follow load changes within seconds.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from pagoda.metrics.base import StatLoggerBase, increase
from pagoda.stats import IterationStats, SchedulerStats

PERCENTILES = (50, 90, 99)
# NOTE: a bound on memory whatever the load: at 1,000 tok/s a 60 s window holds 60,000 ITLs.
MAX_SAMPLES = 100_000


class LiveStatLogger(StatLoggerBase):
    """Rolling-window stats for `GET /stats`.

    Args:
        window_s: how far back latency percentiles and the prefix-cache hit rate look.
        rate_window_s: how far back token throughputs look.
        clock: monotonic seconds; injectable for tests.
    """

    def __init__(self, window_s: float = 60.0, rate_window_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < rate_window_s <= window_s:
            raise ValueError(f"need 0 < rate_window_s <= window_s, got {rate_window_s} "
                             f"and {window_s}")
        self.window_s = window_s
        self.rate_window_s = rate_window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._started = clock()
        self._scheduler = SchedulerStats()
        self._prefix_totals = (0, 0)
        self._ttfts: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)
        self._itls: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)
        # (time, prompt tokens, generation tokens, prefix-cache queries, prefix-cache hits)
        self._steps: deque[tuple[float, int, int, int, int]] = deque(maxlen=MAX_SAMPLES)
        self._finished: deque[tuple[float, str]] = deque(maxlen=MAX_SAMPLES)
        self._totals = {"prompt_tokens": 0, "generation_tokens": 0, "finished_requests": 0}

    def record(self, scheduler_stats: SchedulerStats | None,
               iteration_stats: IterationStats | None) -> None:
        now = self._clock()
        with self._lock:
            queries = hits = 0
            if scheduler_stats is not None:
                last_queries, last_hits = self._prefix_totals
                queries = increase(scheduler_stats.prefix_cache_queries, last_queries)
                hits = increase(scheduler_stats.prefix_cache_hits, last_hits)
                self._prefix_totals = (scheduler_stats.prefix_cache_queries,
                                       scheduler_stats.prefix_cache_hits)
                self._scheduler = scheduler_stats
            if iteration_stats is not None:
                self._add_iteration(now, iteration_stats, queries, hits)
            elif queries:
                self._steps.append((now, 0, 0, queries, hits))
            self._prune(now)

    def _add_iteration(self, now: float, stats: IterationStats, queries: int, hits: int) -> None:
        self._ttfts.extend((now, t) for t in stats.time_to_first_tokens)
        self._itls.extend((now, t) for t in stats.inter_token_latencies)
        self._steps.append((now, stats.num_prompt_tokens, stats.num_generation_tokens,
                            queries, hits))
        self._finished.extend((now, f.finish_reason) for f in stats.finished_requests)
        self._totals["prompt_tokens"] += stats.num_prompt_tokens
        self._totals["generation_tokens"] += stats.num_generation_tokens
        self._totals["finished_requests"] += len(stats.finished_requests)

    def _prune(self, now: float) -> None:
        oldest = now - self.window_s
        for samples in (self._ttfts, self._itls, self._steps, self._finished):
            while samples and samples[0][0] < oldest:
                samples.popleft()

    def log(self) -> None:
        """Nothing to emit: this logger is read through `snapshot()`."""

    def snapshot(self) -> dict[str, Any]:
        """The panel's figures now: gauges, windowed throughputs, percentiles, hit rate.

        Latencies are in milliseconds (None with no sample in the window); throughputs in
        tokens/s over the last `rate_window_s` (or since start, if that is shorter).
        """
        now = self._clock()
        with self._lock:
            self._prune(now)
            sched = self._scheduler
            ttfts = [t for _, t in self._ttfts]
            itls = [t for _, t in self._itls]
            steps = list(self._steps)
            finished = [reason for _, reason in self._finished]
            totals = dict(self._totals)
        rate_since = now - self.rate_window_s
        recent = [s for s in steps if s[0] >= rate_since]
        span = min(self.rate_window_s, max(now - self._started, 1e-9))
        queries = sum(s[3] for s in steps)
        return {
            "uptime_s": now - self._started,
            "window_s": self.window_s,
            "rate_window_s": self.rate_window_s,
            "num_requests_running": sched.num_running_reqs,
            "num_requests_waiting": sched.num_waiting_reqs,
            "kv_cache_usage": sched.kv_cache_usage,
            "prompt_tokens_per_s": sum(s[1] for s in recent) / span,
            "generation_tokens_per_s": sum(s[2] for s in recent) / span,
            "ttft_ms": percentiles_ms(ttfts),
            "itl_ms": percentiles_ms(itls),
            "num_ttft_samples": len(ttfts),
            "num_itl_samples": len(itls),
            "prefix_cache_hit_rate": sum(s[4] for s in steps) / queries if queries else None,
            "num_finished_requests": len(finished),
            "finish_reasons": {r: finished.count(r) for r in sorted(set(finished))},
            "totals": totals,
        }


def percentiles_ms(samples_s: list[float]) -> dict[str, float] | None:
    """{'p50': ms, 'p90': ms, 'p99': ms} of samples in seconds; None when there are none."""
    if not samples_s:
        return None
    values = np.percentile(np.asarray(samples_s) * 1000.0, PERCENTILES)
    return {f"p{p}": float(v) for p, v in zip(PERCENTILES, values, strict=True)}
