"""The stat logger contract: what the engine calls on each of its stats sinks."""

from __future__ import annotations

from abc import ABC, abstractmethod

from pagoda.stats import EngineInfo, IterationStats, SchedulerStats


class StatLoggerBase(ABC):
    """A sink for engine stats.

    Contract: `record` is called from the engine thread after every step, with a snapshot of the
    scheduler (or None) and what the step did (or None); it must be cheap and never block.
    `log` is called about every 5 s from the engine loop.
    """

    @abstractmethod
    def record(self, scheduler_stats: SchedulerStats | None,
               iteration_stats: IterationStats | None) -> None:
        """Takes in one step's stats."""

    @abstractmethod
    def log(self) -> None:
        """Emits whatever this logger emits periodically (may do nothing)."""

    def record_engine_info(self, info: EngineInfo) -> None:  # noqa: B027 - optional hook
        """Takes in what the engine was built with, once, after it is built (default: ignored)."""


def increase(total: int, last: int) -> int:
    """How much a running total grew since `last`; a total that fell was restarted from 0."""
    return total - last if total >= last else total
