"""Stat loggers: the sinks that turn engine stats into Prometheus metrics and a log line.

The engine calls `record(scheduler_stats, iteration_stats)` on every logger after each step
(in its engine thread) and `log()` about every 5 s from its loop. The server answers
`GET /metrics` with `render_metrics()`.

Modules: `base` (the contract), `prometheus` (vLLM's metrics plus `pagoda:*`; the only module
that imports prometheus_client), `log_line` (vLLM's periodic stats line), `kv_report` (the KV
memory report text), `live` (rolling windows for the server's `GET /stats` and web page).
"""

from __future__ import annotations

from pagoda.config import EngineConfig
from pagoda.metrics.base import StatLoggerBase
from pagoda.metrics.kv_report import format_kv_memory_report
from pagoda.metrics.live import LiveStatLogger
from pagoda.metrics.log_line import LoggingStatLogger
from pagoda.metrics.prometheus import (
    DEFAULT_REGISTRY,
    PrometheusStatLogger,
    check_histogram_buckets,
    render_metrics,
)

__all__ = [
    "DEFAULT_REGISTRY", "LiveStatLogger", "LoggingStatLogger", "PrometheusStatLogger",
    "StatLoggerBase", "check_histogram_buckets",
    "default_stat_loggers", "format_kv_memory_report", "render_metrics",
]


def default_stat_loggers(model_name: str, config: EngineConfig, live: LiveStatLogger | None = None,
                         histogram_buckets: dict[str, list[float]] | None = None) -> list[StatLoggerBase]:
    """The engine's loggers: Prometheus always (so /metrics works, its histograms' bounds from
    `histogram_buckets` where given), the log line if log_stats, and `live` when given (the
    server passes the one its `GET /stats` reads).

    NOTE: vLLM's --disable-log-stats also silences /metrics; an operator who turns the log
    line off still wants the dashboard.
    """
    loggers: list[StatLoggerBase] = [PrometheusStatLogger(model_name, config, histogram_buckets=histogram_buckets)]
    if config.log_stats:
        loggers.append(LoggingStatLogger())
    if live is not None:
        loggers.append(live)
    return loggers
